"""Compile progress from the recipe's output: ninja prints `[n/N elapsed] <command>` as each
source finishes (NINJA_STATUS in recipe.py). Each becomes a progress event with elapsed time
and an ETA from the plan's compile estimate, in a terminal or as --json-logs."""
from __future__ import annotations

import re

from contracts.events import EventLog, Progress

NINJA_LINE = re.compile(r"^\s*\[(\d+)/(\d+)(?: ([\d.]+)s)?\]\s*(.*)$")
SOURCE = re.compile(r"([\w.+-]+\.(?:cu|cpp|cc|c))(?:\s|$)")


class CompileProgress:
    def __init__(self, log: EventLog, kernel: str, *, expected_seconds: float | None = None):
        self.progress = Progress(log, "compile", kernel, expected_seconds=expected_seconds)
        self.log = log
        self.kernel = kernel
        self.sources_done = 0

    def feed(self, line: str) -> None:
        match = NINJA_LINE.match(line)
        if match:
            done, total, _elapsed, command = match.groups()
            sources = SOURCE.findall(command)
            what = sources[-1] if sources else "linked"
            self.sources_done = int(done)
            self.progress.update(int(done), f"compiled {what}", total=int(total), force=True)
        elif line.startswith("ftimage: ") and not line.startswith("ftimage: compiled in"):
            self.progress.update(None, line.removeprefix("ftimage: ")[:160], force=True)

    def finish(self, msg: str) -> float:
        return self.progress.finish(msg)
