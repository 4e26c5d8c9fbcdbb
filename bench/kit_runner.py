"""The GPU proof kit's phase runner: timeouts that fire, one overall deadline, results that merge.

Each phase is a command in its own process group, streamed line by line to the kit log while it
runs. Its limit is the smaller of its own timeout and what is left of the kit's deadline; at the
limit the whole group is killed (compilers, training workers and all), the phase is recorded as
timed out, and the kit goes on to write what it has. Phase records are kept in
RESULTS/phases.json across runs: a phase that passed is not run again unless asked (a second run
finishes what the first did not reach), and the summary is written even when a phase fails or
time runs out.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from contracts.errors import FixableError

TIMED_OUT = 124


class ResultsNotWritable(FixableError):
    exit_code = 2   # bench/gpu_proof.py

    def __init__(self, path: Path, why: str):
        super().__init__(f"the results folder {path} is not writable: {why}",
                         "pass --results DIR on a writable volume (or set FTIMAGE_PROOF_OUT)")


class Runner:
    def __init__(self, results: Path, *, deadline_s: float, echo: Callable[[str], None] = print):
        self.results = results
        try:
            results.mkdir(parents=True, exist_ok=True)
            probe = results / ".write-probe"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ResultsNotWritable(results, exc.strerror or str(exc)) from None
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.echo = echo
        self.log = (results / "kit.log").open("a")
        self.phases: dict[str, dict] = self._previous()

    def _previous(self) -> dict[str, dict]:
        path = self.results / "phases.json"
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            return {}

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {text}"
        self.echo(line)
        self.log.write(line + "\n")
        self.log.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def done(self, phase: str) -> bool:
        return self.phases.get(phase, {}).get("exit_code") == 0

    def record(self, phase: str, **fields) -> None:
        self.phases[phase] = {**fields, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        tmp = self.results / ".phases.json.tmp"
        tmp.write_text(json.dumps(self.phases, indent=2) + "\n")
        os.replace(tmp, self.results / "phases.json")

    def skip(self, phase: str, why: str) -> None:
        if not self.done(phase):
            self.record(phase, seconds=0.0, exit_code=None, skipped=why)
        self.say(f"=== {phase}: skipped ({why})")

    def run(self, phase: str, argv: list[str], *, timeout: float, env: dict | None = None, cwd: Path | None = None,
            stdout_to: Path | None = None) -> int:
        """Run one phase; returns its exit code (TIMED_OUT when its limit or the deadline hit)."""
        limit = min(timeout, self.left())
        if self.left() <= 5:
            self.record(phase, seconds=0.0, exit_code=None, skipped="out of time")
            self.say(f"=== {phase}: not started, {self.left():.0f}s left of the kit's deadline")
            return TIMED_OUT
        self.say(f"=== {phase} (limit {limit:.0f}s): {' '.join(argv)}")
        started = time.monotonic()
        out = stdout_to.open("w") if stdout_to else None
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out or subprocess.PIPE, stderr=subprocess.PIPE
                                if out else subprocess.STDOUT, start_new_session=True)
        stream = proc.stderr if out else proc.stdout
        pump = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        pump.start()
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            code = TIMED_OUT
        finally:
            pump.join(timeout=10)
            if out:
                out.close()
        seconds = round(time.monotonic() - started, 1)
        self.record(phase, seconds=seconds, exit_code=code, limit=round(limit, 1),
                    **({"timed_out": True} if code == TIMED_OUT else {}))
        self.say(f"=== {phase}: " + (f"TIMED OUT after {seconds}s (process group killed)" if code == TIMED_OUT
                                     else f"exit {code} after {seconds}s"))
        return code

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.log.write(line)
            if not line.startswith(("USDT:", "STAGE:")):
                sys.stdout.write(line)
        self.log.flush()


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def kill_group(pid: int) -> None:
    """SIGKILL the phase's process group and every descendant: torchrun starts its workers in
    sessions of their own, out of the group's reach, and nvcc jobs may be re-parented."""
    everyone = descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in everyone:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
