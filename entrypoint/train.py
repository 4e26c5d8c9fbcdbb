"""The per-rank worker torchrun starts: `python -m entrypoint.train --plan PLAN.json`.

Thin on purpose: read the plan the launcher wrote, build the Trainer (trainer.py), resume,
fit, finish, report; after the build and after the resume, the ranks agree on a stop request
(loading the model or a checkpoint can take minutes). The launcher has already applied the
verify gate; the plan records its outcome, which this worker copies into run_report.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from contracts import atomic
from contracts.finetune_config import ConfigError
from contracts.folder_guard import UnsafeFolder
from entrypoint.checkpoint.dcp import CheckpointError, DiskFull
from entrypoint.data.sampler import SamplerStateError
from entrypoint.data.sources import DataError
from entrypoint.distributed import collectives
from entrypoint.launcher.export_job import run_export
from entrypoint.launcher.run_plan import RunPlan
from entrypoint.launcher.stop_request import StopRequest, die_with_launcher, hold, watch_launcher
from entrypoint.model import ModelError
from entrypoint.observability.console import Console
from entrypoint.step import NonFiniteLoss
from entrypoint.trainer import Trainer

USER_ERRORS = (ConfigError, DataError, ModelError, SamplerStateError, CheckpointError, NonFiniteLoss,
               UnsafeFolder)  # carry a fix
ONCE_ERRORS = (DiskFull, NonFiniteLoss)
__all__ = ["main", "run"]


def run(plan: RunPlan, stop: StopRequest) -> dict:
    cfg = plan.config
    rank, world, device = collectives.init_distributed(cfg.launch.timeout_minutes)
    if plan.action == "export":
        result = run_export(plan, rank, world, device)
        result["stopped_while_finishing"] = collectives.any_rank(stop(), device)   # a barrier too
        return result
    if plan.allow_fallback:
        Console(rank).every_rank(
            "WARNING: --allow-fallback: training although verify did not pass "
            f"(worst={plan.verify.get('worst')}); batches={plan.packing.effective} "
            f"({plan.packing.reason}). Recorded in run_report.json.")
    trainer = Trainer.build(cfg, plan, rank, world, device)
    trainer.stop_requested = stop
    hold("loaded")   # tests: a stop while the model loads
    stopped = trainer.stopped_loading("the model")
    if not stopped:
        trainer.resume()
        hold("resumed")   # tests: a stop while a checkpoint loads
        stopped = trainer.stopped_loading(f"checkpoint {Path(trainer.resumed_from).name}" if trainer.resumed_from
                                          else "the model")
    if not stopped and plan.action != "finish":   # "finish": the final checkpoint is saved; publish what it owes
        trainer.fit()
    result = trainer.finish()
    # Leave together (a rank tearing down gloo while rank 0 still writes the export can abort at
    # exit: "terminate called without an active exception"), agreeing on a stop that came while
    # the run finished: it finished (checkpoint, export, report), and exits 128 + N all the same.
    stopped = collectives.any_rank(stop(), device)
    result["stopped_while_finishing"] = stopped and not result["interrupted"]
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
    hold("handlers")   # tests: the window before this worker can take a signal
    stop = StopRequest()
    die_with_launcher()
    plan = RunPlan.read(Path(args.plan))
    watch_launcher(stop, plan.config.launch.stop_grace_seconds, int(os.environ.get("RANK", 0)))
    report_path = Path(plan.config.output.dir) / "run_report.json"
    rank = int(os.environ.get("RANK", 0))
    try:
        result = run(plan, stop)
    except Exception as exc:  # noqa: BLE001 - every failure is reported; user errors without a traceback
        user = isinstance(exc, USER_ERRORS)
        msg = str(exc) if user else f"{type(exc).__name__}: {exc}"
        if user and getattr(exc, "fix", "") and "fix:" not in msg:   # errors that keep the fix beside the message
            msg += f"\n  fix: {exc.fix}"
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
    stopped = result["interrupted"] or result.get("stopped_while_finishing")
    if stopped:
        result["stop_signal"] = stop.signal_name or "another rank's"
    if plan.action == "export":
        return stop.exit_code if stopped else 0
    if rank == 0:
        status = "interrupted" if result["interrupted"] else "early_stopped" if result.get("early_stopped") else \
            "completed"
        write_report(report_path, plan, result, status)
        Console(rank).summary(result, report_path)
        if result.get("stopped_while_finishing"):
            Console(rank).info(f"{result['stop_signal']} came while the run was finishing: it finished first (final "
                               f"checkpoint, export, report); exit {stop.exit_code}")
    return stop.exit_code if stopped else 0


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
