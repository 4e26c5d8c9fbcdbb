"""A minimal init for when the entrypoint is PID 1 (`docker run` without `--init`).

The kernel delivers no signal to PID 1 for which it has not installed a handler: a `docker stop`
(SIGTERM) of a PID 1 that is stuck reading, or of a plain `python train.py` exec'd as PID 1, is
ignored until the engine kills it 10 s later, with no checkpoint. So PID 1 forks: the child runs
the command with ordinary signal semantics, and PID 1 forwards every signal sent to it, reaps
orphans, and exits with the child's status (128 + N when the child died of signal N).

Signals the terminal sends (Ctrl-C under `docker run -it`) reach the child's process group
directly; forwarding those too would deliver each Ctrl-C twice, so kernel-originated signals
(si_code SI_KERNEL) are not forwarded.
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH)
SI_KERNEL = 0x80


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def run(main: Callable[[list[str]], int], argv: list[str], *, force: bool = False) -> int:
    """main(argv), supervised when this process is PID 1 (or `force`, for tests)."""
    if os.getpid() != 1 and not force:
        return main(argv)
    watched = {*FORWARDED, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)   # before fork: nothing slips between fork and wait
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    status = None
    while status is None:
        info = signal.sigwaitinfo(watched)
        if info.si_signo != signal.SIGCHLD:
            if info.si_code != SI_KERNEL:
                try:
                    os.kill(child, info.si_signo)
                except ProcessLookupError:
                    pass
            continue
        while True:   # reap every exited child (orphans are re-parented to PID 1)
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == child:
                status = wait_status
    return exit_code(status)
