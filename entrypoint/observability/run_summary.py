"""The run's totals, for the last console line and run_report.json: wall time, time to first step,
tokens trained, mean tokens/s, MFU, peak memory and the best eval loss (where one exists)."""
from __future__ import annotations

import json
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from contracts.events import format_seconds
from contracts.folder_guard import is_real_file, read_bytes_nofollow
from entrypoint.observability.flops import peak_memory_bytes


class AnonPeak:
    """The peak of this process's RssAnon, sampled every 50 ms by a daemon thread (Linux keeps a
    peak only for the whole RSS, which includes shared file pages)."""

    def __init__(self, interval: float = 0.05):
        self.peak = self.now()
        self._interval = interval
        threading.Thread(target=self._run, daemon=True, name="anon-peak").start()

    @staticmethod
    def now() -> int:
        try:
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(self._interval)


@dataclass
class RunTotals:
    launched_at: float                 # time.time() when the launcher started preparing the run
    world: int
    peak_flops: float | None           # per device, FLOP/s; None where unknown (CPU)
    steps: int = 0                     # optimizer steps trained by this run (not the resumed ones)
    tokens: int = 0                    # real tokens trained by this run, all ranks
    train_seconds: float = 0.0         # wall time of those steps (checkpoints excluded)
    flops: float = 0.0
    first_step_at: float | None = None
    best_eval_loss: float | None = None
    best_step: int | None = None
    host_peaks: dict[str, dict] = field(default_factory=dict)   # phase -> this rank's peak host memory (GiB)
    anon: AnonPeak | None = None

    def mark_host_peak(self, phase: str) -> None:
        """This rank's peaks so far, at the end of `phase` (load, steps, export): its private
        (anonymous) memory, sampled, and its RSS (ru_maxrss), which also counts the shared,
        file-backed pages of memory-mapped safetensors and corpora."""
        if self.anon is None:
            self.anon = AnonPeak()
        self.host_peaks[phase] = {"anon": round(self.anon.peak / 2 ** 30, 3),
                                  "rss": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3)}

    def first_step_done(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def add_interval(self, steps: int, tokens: int, flops: float, seconds: float) -> None:
        self.steps += steps
        self.tokens += tokens
        self.flops += flops
        self.train_seconds += seconds

    def to_dict(self) -> dict:
        tok_s = self.tokens / self.train_seconds if self.train_seconds > 0 else None
        mfu = (self.flops / self.train_seconds / self.world / self.peak_flops
               if self.peak_flops and self.train_seconds > 0 else None)
        return {"wall_seconds": round(time.time() - self.launched_at, 1),
                "time_to_first_step_seconds": round(self.first_step_at - self.launched_at, 1)
                if self.first_step_at else None,
                "steps_this_run": self.steps, "tokens_trained": self.tokens,
                "train_seconds": round(self.train_seconds, 2),
                "mean_tokens_per_s": round(tok_s, 1) if tok_s is not None else None,
                "mfu": round(mfu, 4) if mfu is not None else None,
                "best_eval_loss": self.best_eval_loss, "best_step": self.best_step, **peak_memory_bytes()}


def render(summary: dict) -> str:
    """One line: wall 1m02s | first step after 12s | 1.2M tokens at 20.1k tok/s | MFU 41.0% | ..."""
    def count(n: float) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" \
            if n >= 1e3 else f"{n:.0f}"

    parts = [f"wall {format_seconds(summary['wall_seconds'])}"]
    if summary.get("time_to_first_step_seconds") is not None:
        parts.append(f"first step after {format_seconds(summary['time_to_first_step_seconds'])}")
    rate = summary.get("mean_tokens_per_s")
    parts.append(f"{count(summary['tokens_trained'])} tokens" + (f" at {count(rate)} tok/s" if rate else ""))
    parts.append(f"MFU {summary['mfu'] * 100:.1f}%" if summary.get("mfu") is not None else "MFU n/a")
    memory = summary.get("peak_mem_gib", summary.get("peak_rss_gib"))
    if memory is not None:
        parts.append(f"peak {'GPU memory' if 'peak_mem_gib' in summary else 'RSS'} {memory:.2f} GiB")
    if summary.get("best_eval_loss") is not None:
        parts.append(f"best eval loss {summary['best_eval_loss']:.4f} (step {summary['best_step']})")
    return " | ".join(parts)


def logged_loss(path: Path, step: int) -> float:
    """The training loss metrics.jsonl logged at `step` (NaN when it holds none)."""
    loss = float("nan")
    if is_real_file(path):
        for line in read_bytes_nofollow(path).decode("utf-8", "replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step") == step and "loss" in record:
                loss = float(record["loss"])
    return loss
