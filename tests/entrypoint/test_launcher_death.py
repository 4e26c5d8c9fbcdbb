"""A worker stops (checkpoint, then exit 143) when its launcher is gone, and only then: in a
container the launcher is PID 1, so being PID 1's child is the healthy case there."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from entrypoint.launcher.stop_request import LAUNCHER_PID_ENV

pytestmark = pytest.mark.unit

WORKER = """
from entrypoint.launcher.stop_request import StopRequest, die_with_launcher
stop = StopRequest()
die_with_launcher()
print("stop" if stop() else "run")
"""


def _worker(launcher_pid: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    if launcher_pid is not None:
        env[LAUNCHER_PID_ENV] = launcher_pid
    proc = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_worker_whose_launcher_is_alive_keeps_running():
    assert _worker(str(os.getpid())) == "run"      # this process launched it: its parent


def test_a_worker_orphaned_before_it_could_ask_stops():
    assert _worker("999999999") == "stop"          # its recorded launcher is not its parent any more


def test_a_worker_started_by_plain_torchrun_is_left_alone():
    assert _worker(None) == "run"
