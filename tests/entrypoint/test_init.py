"""PID 1 forwards signals: `docker stop` always reaches the command, whatever it is doing."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.chat import REPO, entrypoint_env

pytestmark = pytest.mark.unit


def _pid1_of(unshare: subprocess.Popen) -> int:
    """The host pid of the namespace's PID 1 (unshare -f forks it as its only child)."""
    for _ in range(200):
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


def _wait_for_grandchild(pid: int) -> None:
    for _ in range(400):
        if Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            return
        time.sleep(0.05)
    raise AssertionError("PID 1 started no command")


def _as_a_shell_starts_it() -> None:
    """Signal dispositions and the mask are inherited through exec: a test worker that ignores or
    blocks SIGINT (as test runners and their libraries may) would pass that on to the command,
    which then never sees the signal PID 1 forwards. Start it as a shell would, with both reset."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_pid1_forwards_stop_signals_to_a_command_that_would_ignore_them(sig, code):
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.fail("this test makes a PID namespace and needs root and unshare (CI has both)")
    # As PID 1 without a handler, this python would ignore SIGTERM: `docker stop` would wait for SIGKILL.
    script = "import signal, time; print('ready', flush=True); time.sleep(120)"
    proc = subprocess.Popen(["unshare", "-fp", "--mount-proc", sys.executable, "-m", "entrypoint", sys.executable,
                             "-c", script], cwd=REPO, env=entrypoint_env(), stdout=subprocess.PIPE, text=True,
                            preexec_fn=_as_a_shell_starts_it)
    try:
        pid1 = _pid1_of(proc)
        assert proc.stdout.readline().strip() == "ready"
        _wait_for_grandchild(pid1)
        os.kill(pid1, sig)
        assert proc.wait(timeout=60) == code
    finally:
        proc.kill()


def test_outside_pid1_the_command_runs_in_this_process():
    from entrypoint import pid1 as init

    assert init.run(lambda argv: len(argv), ["a", "b"]) == 2
