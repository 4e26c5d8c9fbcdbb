"""Child processes that die with the build: a `kill -9` of the build must not leave a pip
download or a debootstrap running on, filling the cache behind a dead parent.

On Linux the kernel delivers SIGKILL to the child when its parent dies (PR_SET_PDEATHSIG);
elsewhere children are plain subprocesses.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, with the child tied to this process's life."""
    if sys.platform.startswith("linux"):
        kwargs.setdefault("preexec_fn", _die_with_parent)
    return subprocess.run(cmd, **kwargs)


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    if sys.platform.startswith("linux"):
        kwargs.setdefault("preexec_fn", _die_with_parent)
    return subprocess.Popen(cmd, **kwargs)
