"""The one progress-event schema, for every step that can take long: debootstrap, wheel
downloads, kernel compiles, image builds, tokenisation, training.

Every event has the same fields, so a terminal shows a readable line and `--json-logs`
gives a CI system one JSON object per line:

    {"t": 12.3, "phase": "compile", "step": "flash-attn", "done": 3, "total": 7,
     "elapsed": 95.1, "eta": 120.0, "msg": "..."}

`t` counts from the start of the command; `elapsed` and `eta` from the start of the step.
`done`, `total` and `eta` are null where they are not known.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

SCHEMA_FIELDS = ("t", "phase", "step", "done", "total", "elapsed", "eta", "msg")


def estimate_eta(done: int | None, total: int | None, elapsed: float, expected: float | None = None) -> float | None:
    """Seconds left: from an expected duration (a recorded or estimated cost) while there is
    one and it has not been overrun, else by extrapolating the rate so far."""
    if expected is not None and elapsed < expected:
        if done and total:
            # blend: trust the measured rate more as work completes
            by_rate = elapsed * (total - done) / done
            weight = done / total
            return max(0.0, (1 - weight) * (expected - elapsed) + weight * by_rate)
        return expected - elapsed
    if done and total and done <= total:
        return elapsed * (total - done) / done
    return None


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class EventLog:
    """Writes events to a stream (stderr by default) as text or as JSON lines."""

    def __init__(self, *, json_lines: bool = False, stream: TextIO | None = None, quiet: bool = False):
        self.json_lines = json_lines
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.started = time.monotonic()

    def emit(self, phase: str, msg: str, *, step: str = "", done: int | None = None, total: int | None = None,
             elapsed: float | None = None, eta: float | None = None, **extra: Any) -> None:
        if self.quiet:
            return
        record = {"t": round(time.monotonic() - self.started, 3), "phase": phase, "step": step, "done": done,
                  "total": total, "elapsed": None if elapsed is None else round(elapsed, 1),
                  "eta": None if eta is None else round(eta, 1), "msg": msg, **extra}
        if self.json_lines:
            line = json.dumps(record, sort_keys=True, default=str)
        else:
            line = self._human(record, extra)
        self.stream.write(line + "\n")
        self.stream.flush()

    @staticmethod
    def _human(record: dict, extra: dict) -> str:
        head = f"[{record['phase']:>9}]"
        if record["step"]:
            head += f" {record['step']}"
        if record["total"]:
            head += f" [{record['done']}/{record['total']}]"
        timing = []
        if record["elapsed"] is not None:
            timing.append(f"{format_seconds(record['elapsed'])} elapsed")
        if record["eta"] is not None:
            timing.append(f"ETA {format_seconds(record['eta'])}")
        if timing:
            head += f" ({', '.join(timing)})"
        shown = "  ".join(f"{k}={v}" for k, v in extra.items() if v not in (None, ""))
        text = f"{head}: {record['msg']}" if record["msg"] else head
        return text + (f"  ({shown})" if shown else "")


class Progress:
    """One long step: call `update(done, msg)` as work completes; each call emits an event
    with elapsed time and an ETA (from `expected_seconds` if known, else the rate so far)."""

    def __init__(self, log: EventLog, phase: str, step: str, *, total: int | None = None,
                 expected_seconds: float | None = None, min_interval: float = 0.0):
        self.log, self.phase, self.step = log, phase, step
        self.total = total
        self.expected = expected_seconds
        self.min_interval = min_interval
        self.started = time.monotonic()
        self._last_emit = float("-inf")
        self.done: int | None = 0 if total else None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def update(self, done: int | None = None, msg: str = "", *, total: int | None = None, force: bool = False,
               **extra: Any) -> None:
        if total is not None:
            self.total = total
        if done is not None:
            self.done = done
        now = time.monotonic()
        if not force and now - self._last_emit < self.min_interval and done != self.total:
            return
        self._last_emit = now
        self.log.emit(self.phase, msg, step=self.step, done=self.done, total=self.total, elapsed=self.elapsed,
                      eta=estimate_eta(self.done, self.total, self.elapsed, self.expected), **extra)

    def finish(self, msg: str = "done", **extra: Any) -> float:
        self.log.emit(self.phase, msg, step=self.step, done=self.total, total=self.total, elapsed=self.elapsed,
                      eta=0.0, **extra)
        return self.elapsed
