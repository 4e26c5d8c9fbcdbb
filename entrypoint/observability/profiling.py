"""`output.profile_steps=a:b`: a torch.profiler trace over steps [a, b), top ops, ops per step."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, window: tuple[int, int] | None | str, out_dir: Path, rank: int, log: Callable[[str], None]):
        self.window = window or None
        self.out_dir = out_dir
        self.rank = rank
        self.log = log
        self.prof = None

    def before_step(self, step: int) -> None:
        if self.window and step == self.window[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=False)
            self.prof.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is not None and step == self.window[1] - 1:
            self._finish()

    def close(self) -> None:
        if self.prof is not None:  # the run ended inside the window
            self._finish()

    def _finish(self) -> None:
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"trace-rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        if self.rank != 0:
            return
        a, b = self.window
        events = prof.key_averages()
        sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        n_ops = sum(e.count for e in events if e.key.startswith("aten::"))
        self.log(f"profile of steps {a}..{b - 1} written to {trace}")
        self.log(f"aten ops per step: {n_ops / (b - a):.0f}")
        print(events.table(sort_by=sort, row_limit=15), flush=True)
