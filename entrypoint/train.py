"""The per-rank worker torchrun starts: `python -m entrypoint.train --plan PLAN.json`.

Thin on purpose: read the plan the launcher wrote, build the Trainer (trainer.py), resume,
fit, finish, report. The launcher has already applied the verify gate; the plan records
its outcome, which this worker copies into run_report.json.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from contracts import atomic
from contracts.finetune_config import ConfigError
from entrypoint import collectives
from entrypoint.checkpoint import CheckpointError, DiskFull
from entrypoint.console import Console
from entrypoint.data import DataError
from entrypoint.model import ModelError
from entrypoint.plan import RunPlan
from entrypoint.rundir import RunDirError
from entrypoint.sampler import SamplerStateError
from entrypoint.step import NonFiniteLoss
from entrypoint.trainer import Trainer

USER_ERRORS = (ConfigError, DataError, ModelError, SamplerStateError, CheckpointError, NonFiniteLoss,
               RunDirError)  # carry a fix
ONCE_ERRORS = (DiskFull, NonFiniteLoss)
EXIT_INTERRUPTED = 143   # 128 + SIGTERM, what a stopped container reports


class StopRequest:
    """SIGTERM (docker stop, a preempted pod, torchrun forwarding one) asks the run to stop at
    the next step boundary, after a checkpoint, rather than dying mid-step."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __call__(self) -> bool:
        return self.requested


LAUNCHER_PID_ENV = "FTIMAGE_LAUNCHER_PID"   # set by `finetune`, whose process runs the torchrun agent


def die_with_launcher() -> None:
    """If the launcher dies (even by SIGKILL), this worker gets SIGTERM: it checkpoints at the
    next step boundary and exits, instead of living on as an orphan on the host."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    # The launcher may have died before the prctl took hold. Its PID tells: in a container the
    # launcher is PID 1 itself, so "reparented to PID 1" alone would stop every healthy run.
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if launcher.isdigit() and os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGTERM)


def run(plan: RunPlan, stop: StopRequest) -> dict:
    cfg = plan.config
    rank, world, device = collectives.init_distributed(cfg.launch.timeout_minutes)
    if plan.allow_fallback:
        Console(rank).every_rank(
            "WARNING: --allow-fallback: training although verify did not pass "
            f"(worst={plan.verify.get('worst')}); batches={plan.packing.effective} "
            f"({plan.packing.reason}). Recorded in run_report.json.")
    trainer = Trainer.build(cfg, plan, rank, world, device)
    trainer.stop_requested = stop
    trainer.resume()
    trainer.fit()
    result = trainer.finish()
    # Leave together: a rank tearing down gloo while rank 0 still writes the export can
    # abort at exit ("terminate called without an active exception").
    collectives.barrier(device)
    return result


def write_report(path: Path, plan: RunPlan, result: dict, status: str, error: str = "") -> None:
    report = {"status": status, "error": error, "config": plan.config.to_dict(), "config_file": plan.config_file,
              "overrides": plan.overrides, "verify": plan.verify, "allow_fallback": plan.allow_fallback,
              "packing": asdict(plan.packing), "packing_mode": plan.packing.effective, "lock": plan.lock,
              "topology": plan.topology, "interrupted": False, **result}
    atomic.write_json(path, report, default=str)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m entrypoint.train")
    parser.add_argument("--plan", required=True, help="run plan JSON written by `python -m entrypoint finetune`")
    args = parser.parse_args(argv)
    stop = StopRequest()
    die_with_launcher()
    plan = RunPlan.read(Path(args.plan))
    report_path = Path(plan.config.output.dir) / "run_report.json"
    rank = int(os.environ.get("RANK", 0))
    try:
        result = run(plan, stop)
    except Exception as exc:  # noqa: BLE001 - every failure is reported; user errors without a traceback
        user = isinstance(exc, USER_ERRORS)
        msg = str(exc) if user else f"{type(exc).__name__}: {exc}"
        # one ERROR line per run for what every rank hits alike (a full disk, a NaN loss)
        if rank == 0 or not isinstance(exc, ONCE_ERRORS):
            print(f"[finetune rank{rank}] ERROR: {msg}", file=sys.stderr, flush=True)
        if not user:
            traceback.print_exc()
        if rank == 0:
            write_report(report_path, plan, {"interrupted": stop.requested}, "failed", msg)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        status = "interrupted" if result["interrupted"] else "completed"
        write_report(report_path, plan, result, status)
        what = "stopped by SIGTERM after a checkpoint at" if result["interrupted"] else "done:"
        print(f"[finetune] {what} step {result['final_step']} loss {result['final_loss']:.4f}; "
              f"report {report_path}", flush=True)
    return EXIT_INTERRUPTED if result["interrupted"] else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip C++ static destructors: at interpreter exit a c10d/gloo background thread can
    # still be joinable, and its std::thread destructor aborts the worker ("terminate
    # called without an active exception", exit -6) after a run that fully succeeded;
    # torchrun then reports the whole job as failed. Everything (checkpoints, export,
    # report) is written and fsynced before this point.
    os._exit(code)
