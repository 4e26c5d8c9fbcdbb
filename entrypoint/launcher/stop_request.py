"""A stop request that cannot be lost: from the launcher to every worker, in any phase.

A signal is lost when the launcher sends it before a worker exists, and it kills a worker that
has not installed its handler yet (no checkpoint). So each launch has a stop folder
(FTIMAGE_STOP_DIR, made by the launcher, shared with the agent and the workers of this node):
  * a worker installs its SIGTERM/SIGINT handlers, then writes `ready-<pid>`, then reads `stop`;
  * the launcher, on a stop, writes `stop` (the signal number, atomically), then lists the
    `ready-*` files and signals only those workers (children of its agent).
Whatever the interleaving, each worker is either signalled after its handler is in place, or
finds `stop` when it reads it: the launcher writes `stop` before it lists the ready files, and
the worker writes its ready file before it reads `stop`. No window, no polling.

A worker whose launcher (the torchrun agent) is gone stops as if signalled, however it learnt
it (the kernel's parent-death signal, or the watch below), and exits at the latest
launch.stop_grace_seconds later, whatever phase it was stuck in: no worker outlives its launcher.

Tests only: FTIMAGE_TEST_HOLD=PHASE:FOLDER makes every worker reaching PHASE write
FOLDER/PHASE-reached-<rank> and wait until FOLDER/PHASE-go exists, so a signal or a kill can be
aimed at a window that is otherwise a few milliseconds wide.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from contracts import atomic
from contracts.parent_death import die_with_parent

STOP_DIR_ENV = "FTIMAGE_STOP_DIR"
LAUNCHER_PID_ENV = "FTIMAGE_LAUNCHER_PID"   # a worker's parent: the torchrun agent
SUPERVISOR_PID_ENV = "FTIMAGE_SUPERVISOR_PID"   # the agent's parent: the launcher (supervise.py)
HOLD_ENV = "FTIMAGE_TEST_HOLD"
STOP_FILE = "stop"
READY_PREFIX = "ready-"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopBox:
    """The launcher's side: the stop folder of one launch, removed when the launch ends."""

    def __init__(self, parent: Path):
        self.path = Path(tempfile.mkdtemp(prefix="stop-", dir=parent))   # 0700, a fresh name: nothing stale

    def env(self) -> dict[str, str]:
        return {STOP_DIR_ENV: str(self.path)}

    def request(self, signum: int, workers: list[int]) -> tuple[list[int], list[int]]:
        """Record the stop, then say which of `workers` may be signalled now (ready) and which
        will read it when they are (the rest)."""
        atomic.write_text(self.path / STOP_FILE, str(int(signum)))
        ready = {int(p.name[len(READY_PREFIX):]) for p in self.path.glob(READY_PREFIX + "*")
                 if p.name[len(READY_PREFIX):].isdigit()}
        return [w for w in workers if w in ready], [w for w in workers if w not in ready]

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class StopRequest:
    """A worker's side. SIGTERM (docker stop, a preempted pod) or SIGINT (Ctrl-C, passed on by the
    launcher), or a stop the launcher recorded before this worker was ready, asks the run to stop
    at the next step boundary (or out of an evaluation), after a checkpoint, rather than dying
    mid-step. A second SIGINT stops this worker at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        self._check_in()

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT and self.signum == signal.SIGINT:
            os._exit(128 + signum)   # the launcher already said that nothing more is saved
        self.request(signum)

    def request(self, signum: int) -> None:
        if not self.requested:
            self.requested, self.signum = True, int(signum)

    def _check_in(self) -> None:
        """Ready (the handlers are in place), then the stop the launcher may have recorded before."""
        box = os.environ.get(STOP_DIR_ENV, "")
        if not box or not os.path.isdir(box):
            return   # started by plain torchrun: signals only
        try:
            (Path(box) / f"{READY_PREFIX}{os.getpid()}").touch()
            signum = int((Path(box) / STOP_FILE).read_text())
        except (OSError, ValueError):
            return
        if signum in STOP_SIGNALS:
            self.request(signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)

    def __call__(self) -> bool:
        return self.requested


def _launcher_pid() -> int | None:
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(launcher) if launcher.isdigit() else None


def die_with_launcher() -> None:
    """If the launcher dies (even by SIGKILL), this worker gets SIGTERM: it checkpoints at the
    next step boundary and exits, instead of living on as an orphan on the host. The launcher may
    have died before the request took hold; its PID (the torchrun agent's) tells."""
    die_with_parent(signal.SIGTERM, expected_parent=_launcher_pid())


def watch_launcher(stop: StopRequest, grace_seconds: float, rank: int) -> None:
    """Once the launcher is gone: a stop request now, and an exit after `grace_seconds` if the
    stop has not ended this worker by then (stuck in a collective whose peer died, say)."""
    launcher = _launcher_pid()
    if launcher is None:
        return

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        stop.request(signal.SIGTERM)
        time.sleep(grace_seconds)
        print(f"[finetune rank{rank}] ERROR: the launcher is gone and this worker did not stop within "
              f"launch.stop_grace_seconds={grace_seconds:g}; exiting without a checkpoint", file=sys.stderr,
              flush=True)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def hold(phase: str) -> None:
    """Tests only (FTIMAGE_TEST_HOLD, see above); nothing otherwise."""
    name, _, folder = os.environ.get(HOLD_ENV, "").partition(":")
    if name != phase or not folder:
        return
    Path(folder, f"{phase}-reached-{os.environ.get('RANK', '0')}").touch()
    deadline = time.monotonic() + 600
    while not Path(folder, f"{phase}-go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
