"""The launcher's side of a run: start the torchrun agent in its own session, turn stop signals
into checkpoints, and (with --json-logs) make every line of output a JSON event.

Stop signals. Ctrl-C (SIGINT) and SIGTERM (`docker stop`, a preempted pod) reach the launcher;
the agent and its workers live in other sessions, so a terminal never signals them directly.
  * before `launching:` (verify, tokenising) one ends the launcher there: StopBeforeLaunch, exit
    128 + N, with nothing trained and nothing to save (the verify and tokenizer processes end too,
    and no half-tokenized corpus stays in the cache);
  * from `launching:` on, the first one is recorded and passed to each worker as soon as it can
    take it (stop_request.py: none is lost to a worker still starting), which checkpoints at the
    next step boundary or out of an evaluation, writes run_report.json with `interrupted: true`
    and exits 128 + N (130 for SIGINT, 143 for SIGTERM); torchrun keeps waiting for them, however
    long the checkpoint takes. One that comes while the run finishes lets it finish (final
    checkpoint, export, report), and the exit code is 128 + N all the same;
  * a second SIGINT stops everything at once, and says that nothing more was saved.

One JSON stream. torchrun, gloo/NCCL and the workers write to their file descriptors directly.
With --json-logs the agent's stdout and stderr are pipes read here: a line that already is one
of the project's events passes through, anything else is wrapped into an event (phase
`worker`), so every line on stderr parses as JSON.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from contracts.events import EventLog
from contracts.folder_guard import real_dir
from entrypoint.launcher.stop_request import STOP_SIGNALS, SUPERVISOR_PID_ENV, StopBox


class StopBeforeLaunch(BaseException):
    """SIGINT or SIGTERM before the workers were launched (BaseException, as KeyboardInterrupt is:
    nothing on the way catches it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_behind(exc: BaseException) -> StopBeforeLaunch | None:
    """The stop an error stands in front of: a library's cleanup that raises while a stop unwinds
    through it (datasets' map, asking its interrupted pool for results) replaces the stop with its own
    error, and keeps the stop only as that error's context."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StopBeforeLaunch):
            return exc
        seen.add(id(exc))
        exc = exc.__context__
    return None


class Stops:
    """Every stop signal the launcher gets, `with` it: before `hand_over()` one raises
    StopBeforeLaunch wherever the launcher is; after, it is recorded for the Supervisor."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.handing_over = False
        self.previous: dict = {}
        self.owner = os.getpid()

    def __enter__(self) -> Stops:
        if threading.current_thread() is threading.main_thread():
            self.owner = os.getpid()
            self.previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def hand_over(self) -> None:
        """From here a stop is kept for the workers. One that came before and never unwound the
        launcher (raised where Python prints an exception and goes on: a fork handler of the
        tokenizer pool, a finaliser) ends the launch here, before any worker starts."""
        if self.received and not self.handing_over:
            raise StopBeforeLaunch(self.received[0])
        self.handing_over = True

    def _on_signal(self, signum, _frame) -> None:
        if os.getpid() != self.owner:
            # a forked helper (datasets' tokenizer pool) inherited this handler: it ends as the signal
            # ends any process, quietly; the launcher itself unwinds and says why
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received.append(signum)
        if not self.handing_over:
            raise StopBeforeLaunch(signum)


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = children(p)
        out += kids
        todo += kids
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def is_event(line: str) -> bool:
    try:
        data = json.loads(line)
    except ValueError:
        return False
    return isinstance(data, dict) and "phase" in data and "msg" in data


def _pump(stream, events: EventLog, phase: str) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if not line.strip():
            continue
        if is_event(line):
            events.stream.write(line + "\n")
            events.stream.flush()
        else:
            events.emit(phase, line)


class Supervisor:
    def __init__(self, argv: list[str], env: dict, *, output_dir: str, events: EventLog | None, log,
                 stops: Stops | None = None):
        self.argv = argv
        self.env = env
        self.output_dir = output_dir
        self.events = events           # set: --json-logs (pipes, wrapped); None: inherit the terminal
        self.log = log
        self.given = stops             # the launcher's, already handing over (finetune_cli.py)
        self.stops: list[int] = stops.received if stops else []
        self.proc: subprocess.Popen | None = None
        self.box: StopBox | None = None
        self.killed = False            # stopped at once by a second Ctrl-C

    def run(self) -> int:
        with contextlib.nullcontext(self.given) if self.given else Stops() as stops:
            stops.hand_over()
            self.stops = stops.received
            self.box = StopBox(real_dir(Path(self.output_dir) / ".launch"))
            try:
                code = self._run()
            finally:
                self.box.close()
        if self.stops and code == 0:
            code = 128 + self.stops[0]   # the run finished, and was asked to stop: the caller hears it
        return code

    def _run(self) -> int:
        pipes = subprocess.PIPE if self.events is not None else None
        env = {**self.env, **self.box.env(), SUPERVISOR_PID_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True, stdout=pipes, stderr=pipes)
        pumps = []
        if self.events is not None:
            pumps = [threading.Thread(target=_pump, args=(s, self.events, "worker"), daemon=True)
                     for s in (self.proc.stdout, self.proc.stderr)]
            for pump in pumps:
                pump.start()
        handled = 0
        while True:
            try:
                code = self.proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            while handled < len(self.stops):
                self._stop(self.stops[handled], first=handled == 0)
                handled += 1
        for pump in pumps:
            pump.join(timeout=10)
        return 128 + signal.SIGINT if self.killed else code

    def _stop(self, signum: int, *, first: bool) -> None:
        name = signal.Signals(signum).name
        workers = children(self.proc.pid)
        if first:
            ready, starting = self.box.request(signum, workers)
            self.log(f"[finetune] stop requested ({name}): the workers checkpoint at the next step boundary and exit"
                     + ("; Ctrl-C again stops at once, saving nothing more" if signum == signal.SIGINT else "")
                     + ("" if ready else "; the workers still starting stop as soon as they are ready"))
            _signal(ready, signum)
            return
        if signum != signal.SIGINT:
            return   # a repeated SIGTERM changes nothing: the checkpoint is on its way
        everything = [self.proc.pid, *descendants(self.proc.pid)]
        _signal(everything, signal.SIGKILL)
        self.killed = True
        self.log("[finetune] stopped at once by a second Ctrl-C: nothing more was saved; rerun the same command to "
                 f"resume from the newest checkpoint in {self.output_dir}/checkpoints")


def run_agent(torchrun_argv: list[str], env: dict, output_dir: str, *, events: EventLog | None, log,
              stops: Stops | None = None) -> int:
    """Start `python -m entrypoint.launcher.agent` for this torchrun command line and supervise it."""
    start = torchrun_argv.index("torch.distributed.run") + 1
    flags = ["-I"] if sys.flags.isolated else []
    argv = [sys.executable, *flags, "-m", "entrypoint.launcher.agent", output_dir, *torchrun_argv[start:]]
    started = time.monotonic()
    code = Supervisor(argv, env, output_dir=output_dir, events=events, log=log, stops=stops).run()
    if code < 0:
        code = 128 - code
    if events is not None:
        events.emit("finetune", f"run ended with exit code {code}", elapsed=time.monotonic() - started,
                    exit_code=code)
    return code
