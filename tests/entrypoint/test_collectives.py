"""Every collective the trainer issues runs on the training device.

A NCCL group has no CPU backend, so a CPU tensor in any collective crashes the first GPU step.
These tests reproduce that on a CPU machine: a process group whose only backend is bound to a
non-CPU device type (meta, through torch's fake process group) refuses CPU tensors with the same
error, and the trainer's real step code runs under it with every tensor on that device."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from entrypoint.data.micro_batches import build_micro_batch
from entrypoint.data.tokenize import BadRows, Corpus
from entrypoint.distributed import collectives
from entrypoint.step import NonFiniteLoss, read_interval, run_step

pytestmark = pytest.mark.unit
META = torch.device("meta")


@pytest.fixture
def meta_only_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("meta:fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class TinyLM(torch.nn.Module):
    """A stand-in causal LM (embedding + head): what is under test is the step around it."""

    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, use_cache=False, **_boundaries):
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


def _micro_batches(packed: bool) -> list:
    rng = np.random.default_rng(0)
    lengths = np.array([12, 7, 20, 5])
    tokens = rng.integers(1, 64, int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    corpus = Corpus.from_arrays(tokens, tokens.copy(), offsets, np.arange(4), BadRows(), 4)
    return [build_micro_batch(corpus, [0, 1], packed=packed, budget=32, pad_token_id=0),
            build_micro_batch(corpus, [2, 3], packed=packed, budget=32, pad_token_id=0)]


def test_gpu_processes_get_a_cpu_backend_too():
    assert collectives.backend_for(torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert collectives.backend_for(torch.device("cpu")) == "gloo"


def test_a_device_only_group_refuses_cpu_tensors_as_nccl_does(meta_only_group):
    """What the first GPU step of earlier releases hit: the counts were a CPU tensor."""
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("packed", [True, False])
def test_the_training_step_issues_every_collective_on_the_training_device(meta_only_group, packed):
    seen: list[torch.device] = []
    real = dist.all_reduce

    def checked(tensor, *args, **kwargs):
        seen.append(tensor.device)
        return real(tensor, *args, **kwargs)

    with torch.device("meta"):
        model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0)
    reads: list[torch.Tensor] = []

    def readback(tensor):        # a meta tensor holds no values: the one host read is observed here
        reads.append(tensor)
        return [0.0, 1.0]

    dist.all_reduce = checked
    try:
        outcome = run_step(model, optimizer, scheduler, _micro_batches(packed), device=META, world=2, grad_clip=1.0,
                           loss_chunk_tokens=0, stop=False, step=1, epoch=0, data_s=0.0, readback=readback)
        with pytest.raises(RuntimeError, match="meta tensor"):   # reading back the interval is the logging sync
            read_interval([outcome.pending], META, 1)
    finally:
        dist.all_reduce = real
    assert seen and set(seen) == {META}, seen
    assert [t.device for t in reads] == [META] and reads[0].shape == (2,)
    assert outcome.stop_requested is False and outcome.pending.counts.device == META


def test_a_non_finite_gradient_norm_stops_before_the_optimizer_step(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = TinyLM()
        with torch.no_grad():
            model.head.weight[0, 0] = float("nan")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0)
        with pytest.raises(NonFiniteLoss, match="gradient norm became nan at step 7"):
            run_step(model, optimizer, scheduler, _micro_batches(True), device=torch.device("cpu"), world=1,
                     grad_clip=1.0, loss_chunk_tokens=0, stop=False, step=7, epoch=0, data_s=0.0)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, before[name], equal_nan=True, rtol=0, atol=0)
        assert not optimizer.state   # the optimizer never stepped
    finally:
        dist.destroy_process_group()
