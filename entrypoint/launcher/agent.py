"""The torchrun agent, in its own session: `python -m entrypoint.launcher.agent OUTPUT_DIR TORCHRUN_ARGS...`.

torchrun (`torch.distributed.run`) is called in this process as a library, so its behaviour is
unchanged but a worker failure ends in one clear line rather than the agent's own traceback:
the failing worker has already printed its ERROR with a fix.

The launcher (supervise.py) starts this in a new session, so a terminal's Ctrl-C reaches the
launcher alone: it asks the workers to checkpoint and stop, while torchrun keeps waiting for
them, with no 30-second kill deadline of its own.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from contracts.parent_death import die_with_parent
from entrypoint.launcher.stop_request import LAUNCHER_PID_ENV, SUPERVISOR_PID_ENV
from entrypoint.observability.console import err, log

__all__ = ["LAUNCHER_PID_ENV", "main", "run"]


def quiet_torchrun() -> None:
    """torchrun's own log lines ("Sending process N closing signal", "failed (exitcode: 143)") repeat
    what the workers and this agent already say in one line each; keep them for real crashes only."""
    for name in ("torch.distributed.elastic", "torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.api", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def run(output_dir: str, torchrun_args: list[str]) -> int:
    # torch after main() has armed die_with_parent: the agent dies with the launcher while torch loads
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    quiet_torchrun()
    try:
        torchrun(parse_args(torchrun_args))
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        if codes <= {130, 143, -2, -15}:   # the workers stopped on request after checkpointing
            return 130 if codes & {130, -2} else 143
        ranks = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(exc.failures.items()))
        err(f"training failed on {ranks}; the worker's ERROR line above says why",
            f"see {output_dir}/run_report.json; fix the cause and rerun with the same output.dir to resume")
        return 1
    except SignalException as exc:
        # the agent itself was signalled (not through the launcher): torchrun forwarded it to the workers
        log(f"[finetune] stopped by signal {exc.sigval}; rerun the same command to resume from {output_dir}")
        return 128 + int(exc.sigval)
    return 0


def main(argv: list[str]) -> int:
    # the launcher died (even before this call): the agent gets SIGTERM, the workers then theirs
    launcher = os.environ.get(SUPERVISOR_PID_ENV, "")
    die_with_parent(signal.SIGTERM, expected_parent=int(launcher) if launcher.isdigit() else None)
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
