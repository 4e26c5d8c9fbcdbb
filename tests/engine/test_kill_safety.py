"""kill -9 of a build mid-download leaves no pip running behind it, and the next run sweeps
the dead build's scratch folder before it starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.engine


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def test_kill_9_during_pip_download_leaves_no_orphan_and_no_scratch(tmp_path):
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "build", "images/smoke", "--render", str(tmp_path / "ctx"), "--cache", str(cache)]
    build = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not [p for p in _processes_mentioning(str(cache)) if p != build.pid]:
        assert build.poll() is None, "the build ended before pip started"
        assert time.monotonic() < deadline, "pip download never started"
        time.sleep(0.05)
    os.kill(build.pid, signal.SIGKILL)
    build.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(cache)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(cache)) == [], "pip outlived the killed build"
    leftovers = list((cache / "scratch").iterdir())
    assert leftovers, "the kill came after the download finished; nothing was tested"

    again = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [p for p in (cache / "scratch").iterdir() if p.name in {q.name for q in leftovers}]
    assert not (tmp_path / "ctx").joinpath(".tmp").exists() and (tmp_path / "ctx" / "Dockerfile").is_file()
