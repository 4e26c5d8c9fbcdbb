"""The verify report: one row per check, a worst status, a table, JSON and an exit code.

Modelled on health-check tools (ds_report, cog doctor) with ds_report's mistake fixed: the exit
code follows the worst status, so a script or the entrypoint can act on it.
"""
from __future__ import annotations

import enum
import json
import math
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

JSON_SCHEMA_VERSION = 1


class Status(enum.IntEnum):
    """Ordered by severity; the report's worst status is the max."""

    SKIP = 0   # does not apply to this image (e.g. no triton kernel in the lock); never "work avoided"
    PASS = 1
    WARN = 2
    FAIL = 3


# exit code per worst status: 0 pass, 1 warn, 2 fail. SKIP ranks below PASS so a report of passes
# plus not-applicable rows reads PASS; work that could not be done is a FAIL, never a SKIP.
EXIT_CODES = {Status.PASS: 0, Status.SKIP: 0, Status.WARN: 1, Status.FAIL: 2}


@dataclass(frozen=True)
class CheckResult:
    """One row of the report."""

    check: str                 # dotted name, e.g. "dispatch.causal_conv1d_fn"
    status: Status
    detail: str
    fix: str = ""              # what the user should do; required for WARN/FAIL
    data: dict[str, Any] = field(default_factory=dict)  # measured numbers, for --json consumers

    def __post_init__(self):
        for name in ("check", "detail", "fix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{self.check}: {name} must be text, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.data, dict):
            raise TypeError(f"{self.check}: data must be a dict")
        if self.status in (Status.WARN, Status.FAIL) and not self.fix:
            raise ValueError(f"{self.check}: a {self.status.name} row needs a fix")

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status.name, "detail": self.detail,
                "fix": self.fix, "data": _json_safe(self.data)}


@dataclass(frozen=True)
class Report:
    results: tuple[CheckResult, ...]

    @classmethod
    def of(cls, results: Iterable[CheckResult]) -> Report:
        return cls(tuple(results))

    @property
    def worst(self) -> Status:
        # An empty report proves nothing, so it must not read as PASS.
        if not self.results:
            return Status.FAIL
        return max(r.status for r in self.results)

    @property
    def passed(self) -> bool:
        """True only when nothing warned or failed; the entrypoint's gate."""
        return EXIT_CODES[self.worst] == 0

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.worst]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": JSON_SCHEMA_VERSION,
            "worst": self.worst.name,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "results": [r.to_dict() for r in self.results],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """Read back to_dict() output (e.g. to print the table of a saved --json run)."""
        return cls.of(CheckResult(r["check"], Status[r["status"]], r["detail"], r.get("fix", ""), r.get("data", {}))
                      for r in data["results"])

    def to_table(self, width: int = 200) -> str:
        return render_table(self.results, width=width) + f"\nRESULT: {self.worst.name} (exit {self.exit_code})\n"


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON (jq and most parsers reject them): a measurement that does not exist is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


_HEADERS = ("CHECK", "STATUS", "DETAIL", "FIX")


def render_table(results: Iterable[CheckResult], width: int = 200) -> str:
    """Plain-text table; DETAIL and FIX wrap inside their columns so long messages stay readable."""
    rows = [(r.check, r.status.name, r.detail, r.fix) for r in results]
    check_w = max([len(_HEADERS[0])] + [len(r[0]) for r in rows])
    status_w = len("STATUS")
    free = max(40, width - check_w - status_w - 9)
    detail_w = free * 3 // 5
    fix_w = free - detail_w
    widths = (check_w, status_w, detail_w, fix_w)

    def line(cells: tuple[str, ...]) -> list[str]:
        wrapped = [textwrap.wrap(c, w) or [""] for c, w in zip(cells, widths)]
        height = max(len(w) for w in wrapped)
        return [
            " | ".join((w[i] if i < len(w) else "").ljust(widths[j]) for j, w in enumerate(wrapped)).rstrip()
            for i in range(height)
        ]

    out = line(_HEADERS)
    out.append("-+-".join("-" * w for w in widths))
    for row in rows:
        out.extend(line(row))
    return "\n".join(out)
