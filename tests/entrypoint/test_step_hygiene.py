"""Step hygiene, as the best trainers keep it: at most one host sync per non-logging step.

A host sync (`.item()`, `.tolist()`, `float()`, `bool()`, `int()` on a device tensor) stalls the
CPU until the GPU drains its queue; one per step is the price of deciding whether to step the
optimizer at all. Counted here on a real Trainer (tiny Qwen3.5 hybrid, one gloo rank), for the
calls the project's own code makes (transformers' modeling code is not ours to count)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from entrypoint.launcher.preflight import prepare
from entrypoint.launcher.verify_gate import GateOutcome
from tests.fixtures.chat import entrypoint_env

pytestmark = pytest.mark.unit
PROJECT = Path(__file__).resolve().parents[2] / "entrypoint"
SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__,
         torch.Tensor.__int__}


class HostSyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            caller = sys._getframe(1)   # who called the tensor method (torch's own syncs, e.g. in an
            #                             optimizer on CPU, are not the project's)
            while caller and caller.f_code.co_filename.endswith(("torch/_tensor.py", "torch/overrides.py")):
                caller = caller.f_back
            if caller and Path(caller.f_code.co_filename).is_relative_to(PROJECT):
                self.calls.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {func.__name__}")
        return func(*args, **(kwargs or {}))


def _passing_gate(**_):
    return GateOutcome(passed=True, worst="PASS", table="(test stand-in for a passing verify)", report={})


@pytest.fixture
def trainer(fixture_dir, tmp_path):
    from entrypoint.trainer import Trainer

    launch = prepare(config_file=str(fixture_dir.config), allow_fallback=False, env=entrypoint_env(),
                     overrides=[f"output.dir={tmp_path / 'out'}", "train.max_steps=6", "output.log_every=3",
                                "checkpoint.every=0", "launch.nproc_per_node=1"], log=lambda m: None,
                     gate=_passing_gate)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield Trainer.build(launch.plan.config, launch.plan, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_one_host_sync_per_step_and_the_interval_is_read_once(trainer):
    per_step = []
    for _ in range(3):
        trainer.step += 1
        with HostSyncCounter() as counter:
            outcome = trainer.train_step()
        trainer.pending.append(outcome.pending)
        per_step.append(counter.calls)
    assert [len(c) for c in per_step] == [1, 1, 1], per_step
    assert all("step.py" in c[0] for c in per_step)
    with HostSyncCounter() as counter:
        record = trainer.log_interval(1.0)
    assert len(counter.calls) == 1, counter.calls
    assert record["step"] == 3 and record["loss"] > 0 and record["grad_norm"] > 0 and record["loss_tokens"] > 0
    assert trainer.pending == []
