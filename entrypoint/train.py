"""The per-rank worker torchrun starts: `python -m entrypoint.train --plan PLAN.json`.

Thin on purpose: read the plan the launcher wrote, build the Trainer (trainer.py), resume,
fit, finish, report. The launcher has already applied the verify gate; the plan records
its outcome, which this worker copies into run_report.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from contracts.finetune_config import ConfigError, from_dict
from entrypoint.checkpoint import CheckpointError
from entrypoint.data import DataError
from entrypoint.model import ModelError
from entrypoint.sampler import SamplerStateError
from entrypoint.trainer import Console, Trainer

USER_ERRORS = (ConfigError, DataError, ModelError, SamplerStateError, CheckpointError)  # carry a fix; no traceback


def init_distributed() -> tuple[int, int, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def run(plan: dict) -> dict:
    cfg = from_dict(plan["config"])
    rank, world, device = init_distributed()
    if plan["allow_fallback"]:
        Console(rank).every_rank(
            "WARNING: --allow-fallback: training although verify did not pass "
            f"(worst={plan['verify'].get('worst')}); batches={plan['packing']['effective']} "
            f"({plan['packing']['reason']}). Recorded in run_report.json.")
    trainer = Trainer.build(cfg, plan, rank, world, device)
    trainer.resume()
    trainer.fit()
    result = trainer.finish()
    # Leave together: a rank tearing down gloo while rank 0 still writes the export can
    # abort at exit ("terminate called without an active exception").
    dist.barrier()
    return result


def write_report(path: Path, plan: dict, result: dict, status: str, error: str = "") -> None:
    report = {"status": status, "error": error, "config": plan["config"], "config_file": plan.get("config_file"),
              "overrides": plan.get("overrides", []), "verify": plan["verify"],
              "allow_fallback": plan["allow_fallback"], "packing": plan["packing"],
              "packing_mode": plan["packing"]["effective"], "lock": plan.get("lock"),
              "topology": plan.get("topology"), **result}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m entrypoint.train")
    parser.add_argument("--plan", required=True, help="run plan JSON written by `python -m entrypoint finetune`")
    args = parser.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    report_path = Path(plan["config"]["output"]["dir"]) / "run_report.json"
    rank = int(os.environ.get("RANK", 0))
    try:
        result = run(plan)
    except Exception as exc:  # noqa: BLE001 - every failure is reported; user errors without a traceback
        user = isinstance(exc, USER_ERRORS)
        msg = str(exc) if user else f"{type(exc).__name__}: {exc}"
        print(f"[finetune rank{rank}] ERROR: {msg}", file=sys.stderr, flush=True)
        if not user:
            traceback.print_exc()
        if rank == 0:
            write_report(report_path, plan, {}, "failed", msg)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        write_report(report_path, plan, result, "completed")
        print(f"[finetune] done: step {result['final_step']} loss {result['final_loss']:.4f}; "
              f"report {report_path}", flush=True)
    return 0


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
