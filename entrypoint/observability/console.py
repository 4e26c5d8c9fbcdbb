"""What a run prints: one line per logged step with elapsed time and an ETA, and, with
--json-logs, the same as events in the project's one schema (contracts.events)."""
from __future__ import annotations

import os
import sys

from contracts.events import EventLog, format_seconds

JSON_LOGS_ENV = "FTIMAGE_JSON_LOGS"   # set by `finetune --json-logs`; the workers inherit it
ALLOW_FALLBACK_ENV = "FTIMAGE_ALLOW_FALLBACK"


def err(message: str, fix: str = "") -> None:
    """A CLI error: one line, then the fix."""
    print(f"error: {message}", file=sys.stderr)
    if fix:
        print(f"  fix: {fix}", file=sys.stderr)


def log(message: str) -> None:
    # progress goes to stderr so stdout stays machine-readable (--dry-run / --json print JSON)
    print(message, file=sys.stderr, flush=True)


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class Console:
    def __init__(self, rank: int):
        self.rank = rank
        self.events = EventLog(json_lines=True) if os.environ.get(JSON_LOGS_ENV) == "1" else None

    def info(self, msg: str) -> None:
        if self.rank != 0:
            return
        if self.events is not None:
            self.events.emit("finetune", msg)
        else:
            print(f"[finetune] {msg}", flush=True)

    def warn(self, msg: str) -> None:
        self.info(f"WARNING: {msg}")

    def summary(self, result: dict, report_path) -> None:
        """The run's last line: what it did, its totals, where the report is."""
        # run_summary imports torch (flops): every command imports this module first (cli.py)
        from entrypoint.observability.run_summary import render

        if self.rank != 0:
            return
        if result.get("stopped_while_loading"):
            head = (f"stopped by {result.get('stop_signal') or 'a signal'} while loading "
                    f"{result['stopped_while_loading']}, before step {result['final_step'] + 1}: nothing trained, "
                    "nothing saved; rerun the same command to start (or resume)")
        elif result["interrupted"]:
            head = (f"stopped by {result.get('stop_signal') or 'a signal'} after a checkpoint at step "
                    f"{result['final_step']}; rerun the same command to resume")
        elif result.get("early_stopped"):
            head = (f"early stopped at step {result['final_step']}: best eval loss {result['best_eval_loss']:.4f} at "
                    f"step {result['best_step']}")
        else:
            head = f"done: step {result['final_step']}, loss {result['final_loss']:.4f}"
        if self.events is not None:
            self.events.emit("summary", head, report=str(report_path), **result["summary"])
        else:
            print(f"[finetune] {head} | {render(result['summary'])} | report {report_path}", flush=True)

    def every_rank(self, msg: str) -> None:
        if self.events is not None:
            self.events.emit("finetune", msg, rank=self.rank)
        else:
            print(f"[finetune rank{self.rank}] {msg}", file=sys.stderr, flush=True)

    def step(self, rec: dict, max_steps: int, elapsed: float, eta: float | None) -> None:
        if self.rank != 0:
            return
        if self.events is None:
            print(f"[finetune] {format_record(rec, max_steps)} elapsed {format_seconds(elapsed)} "
                  f"ETA {format_seconds(eta)}", flush=True)
        else:
            self.events.emit("train", f"loss {rec['loss']:.4f}", step="step", done=rec["step"], total=max_steps,
                             elapsed=elapsed, eta=eta, loss=round(rec["loss"], 6), epoch=rec["epoch"],
                             tokens_per_s=round(rec["tokens_per_s"], 1))


def format_record(rec: dict, max_steps: int) -> str:
    mfu = f"{rec['mfu'] * 100:.1f}%" if rec["mfu"] is not None else "n/a"
    return (f"step {rec['step']}/{max_steps} epoch {rec['epoch']} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
            f"tok/s {rec['tokens_per_s']:.0f} pad {rec['padding_ratio']:.1%} pack {rec['packing_efficiency']:.1%} "
            f"mfu {mfu} step {rec['step_time_s'] * 1e3:.0f}ms (data {rec['data_time_s'] * 1e3:.0f}ms)")
