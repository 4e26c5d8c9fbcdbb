"""Phase-tagged build events, readable by a person or (with --json-logs) by a CI system."""
from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO


class EventLog:
    def __init__(self, *, json_lines: bool = False, stream: TextIO | None = None, quiet: bool = False):
        self.json_lines = json_lines
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.started = time.monotonic()

    def emit(self, phase: str, message: str, **fields: Any) -> None:
        if self.quiet:
            return
        if self.json_lines:
            record = {"t": round(time.monotonic() - self.started, 3), "phase": phase, "msg": message, **fields}
            self.stream.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        else:
            extra = "  ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, ""))
            self.stream.write(f"[{phase:>9}] {message}" + (f"  ({extra})" if extra else "") + "\n")
        self.stream.flush()


class PhaseTimer:
    """Records wall time per phase for the build report."""

    def __init__(self, log: EventLog):
        self.log = log
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.monotonic()
                return self

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.monotonic() - self.t0
                return False

        return _Phase()
