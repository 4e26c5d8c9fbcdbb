"""The one plain-text table printer (build plans, check results, verify's report)."""
from __future__ import annotations

import textwrap
from collections.abc import Sequence


def render_table(rows: Sequence[Sequence[object]], header: Sequence[str], *,
                 wrap: dict[int, int] | None = None, separator: str = "  ") -> str:
    """Columns padded to their widest cell. `wrap` maps a column index to a width at which
    that column's cells wrap onto continuation lines (long details and fixes stay readable)."""
    wrap = wrap or {}
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = []
    for i in range(len(header)):
        widest = max(len(r[i]) for r in cells)
        widths.append(min(widest, wrap[i]) if i in wrap else widest)

    def lines(row: list[str]) -> list[str]:
        parts = [textwrap.wrap(c, widths[i]) or [""] if i in wrap else [c] for i, c in enumerate(row)]
        height = max(len(p) for p in parts)
        return [separator.join((p[j] if j < len(p) else "").ljust(widths[i]) for i, p in enumerate(parts)).rstrip()
                for j in range(height)]

    # "  " gives a dashed rule; " | " gives "-+-" between columns
    rule = separator.replace(" ", "-").replace("|", "+").join("-" * w for w in widths)
    out = lines(cells[0]) + [rule]
    for row in cells[1:]:
        out.extend(lines(row))
    return "\n".join(out)
