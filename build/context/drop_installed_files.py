"""Drop files from installed wheels together with their RECORD rows.

    python drop_installed_files.py SITE_PACKAGES '*.a' [PATTERN ...]

Runs inside the builder stage with the venv's own interpreter (stdlib only). Deleting a file
that a wheel installed but leaving its RECORD row makes the installation disagree with
itself: verify hashes every RECORD row and would report the file as missing, and the image
would fail its own check. So a dropped file loses its row too, and the RECORD stays an exact
list of what is installed.

Static archives (`*.a`) are the one use today: link-time inputs that nothing loads at run
time (about 180 MB in the CUDA wheels, mostly Triton's CUPTI libraries).
"""
from __future__ import annotations

import csv
import fnmatch
import io
import os
import sys
from pathlib import Path


def drop(site_packages: Path, patterns: list[str]) -> list[str]:
    """Delete every RECORD-listed file whose name matches a pattern, and its row. Returns the
    dropped paths (relative to site-packages), sorted."""
    dropped: list[str] = []
    for record in sorted(site_packages.glob("*.dist-info/RECORD")):
        rows = list(csv.reader(io.StringIO(record.read_text(encoding="utf-8"))))
        kept = []
        for row in rows:
            if row and any(fnmatch.fnmatch(os.path.basename(row[0]), p) for p in patterns):
                target = (site_packages / row[0]).resolve()
                if site_packages.resolve() not in target.parents:
                    raise SystemExit(f"{record}: row {row[0]!r} points outside {site_packages}")
                if target.is_file():
                    target.unlink()
                dropped.append(row[0])
                continue
            kept.append(row)
        if len(kept) != len(rows):
            out = io.StringIO()
            csv.writer(out, lineterminator="\n").writerows(kept)
            record.write_text(out.getvalue(), encoding="utf-8")
    return sorted(dropped)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dropped = drop(Path(argv[0]), argv[1:])
    print(f"dropped {len(dropped)} file(s) matching {' '.join(argv[1:])} with their RECORD rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
