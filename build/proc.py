"""Child processes that die with the build: a `kill -9` of the build must not leave a pip
download or a debootstrap running on, filling the cache behind a dead parent.

On Linux the kernel delivers SIGKILL to the child when its parent dies (contracts/parent_death.py);
elsewhere children are plain subprocesses.
"""
from __future__ import annotations

import subprocess
import sys

from contracts.parent_death import preexec_kill_with_parent


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, with the child tied to this process's life."""
    if sys.platform.startswith("linux"):
        kwargs.setdefault("preexec_fn", preexec_kill_with_parent)
    return subprocess.run(cmd, **kwargs)


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    if sys.platform.startswith("linux"):
        kwargs.setdefault("preexec_fn", preexec_kill_with_parent)
    return subprocess.Popen(cmd, **kwargs)
