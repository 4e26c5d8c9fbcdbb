"""The front door for JSON lines: every line read bounded, every bad one a verdict, never a crash.

A line that is not UTF-8, is longer than data.max_row_bytes, does not parse or is not an object
becomes a marker the encoder counts under its reason; no line is ever held in memory whole beyond
the limit, and one bad line never stops the file.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TooLarge:
    limit: int


def read_raw_lines(path: str, max_row_bytes: int = 8 << 20, progress=None) -> Iterator[str | None | TooLarge]:
    """Each non-blank line of a JSON-lines file as text; None when it is not UTF-8, TooLarge when it
    is over max_row_bytes (the rest of that line is skipped without being kept)."""
    p = Path(path)
    total = p.stat().st_size
    count = 0
    with p.open("rb") as fh:
        while True:
            raw = fh.readline(max_row_bytes + 1)
            if not raw:
                return
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                while (more := fh.readline(1 << 20)) and not more.endswith(b"\n"):
                    pass  # skip the rest of the line without keeping it
                yield TooLarge(max_row_bytes)
            elif raw.strip():
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield None
            else:
                continue
            count += 1
            if progress is not None and count % 256 == 0:
                progress(fh.tell(), total)


def parse_line(raw: str | None | TooLarge) -> object:
    """The row a raw line holds, or a marker the encoder turns into its bad-row reason."""
    if isinstance(raw, TooLarge) or raw is None:
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return raw   # text that is not JSON: counted as invalid_json


def row_problem(row: object) -> str:
    """The reason for a row the front door already knows is bad ("" when it is an object)."""
    if isinstance(row, TooLarge):
        return "row_too_large"
    if row is None:
        return "not_utf8"
    if isinstance(row, str):
        return "invalid_json"
    if not isinstance(row, dict):
        return "not_an_object"
    return ""
