"""Tie a process's life to its parent's: when the parent dies, even by SIGKILL, the kernel sends
this process a signal (Linux PR_SET_PDEATHSIG), so no build step or training worker lives on as
an orphan filling a cache or holding a GPU.

The setting belongs to the calling thread's process and is cleared by the kernel on fork, so a
child calls it for itself: as `preexec_fn` of a subprocess, or first thing in its own main().
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, *, expected_parent: int | None = None) -> bool:
    """Ask for `sig` when the parent dies. Returns False where the kernel has no such setting.

    The parent may already have died before the request took hold: with `expected_parent` given,
    a process whose parent is no longer that PID sends itself `sig` at once. (Being reparented
    alone says nothing: the expected parent may itself be PID 1's child.)
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def preexec_kill_with_parent() -> None:
    """`preexec_fn` for a subprocess that must die (SIGKILL) with this process."""
    die_with_parent(signal.SIGKILL)
