"""One optimizer step, with one host sync.

What a step needs from the host is decided by the data (token counts, known before the
forward) and by the signal handler (a stop request). Both go to the device and travel in the
step's one all-reduce. Everything else stays on the device: the loss is scaled by the global
token count as a device tensor, the gradient norm is computed and clipped on the device, and
the only read-back is [stop requested, gradient norm], which the step needs to decide whether
to step the optimizer at all (a non-finite norm stops the run before the weights change).
Loss, counts and norms of the interval are read back once, on logging steps (`read_interval`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from contracts.errors import FixableError
from entrypoint.data.micro_batches import MicroBatch
from entrypoint.distributed import collectives
from entrypoint.loss import loss_sum, to_device

# positions in the step's all-reduced counts
N_LOSS, N_REAL, AREA, SUM_SQ, STOP = range(5)


class NonFiniteLoss(FixableError):
    """The loss or the gradient norm became NaN or inf: the run stops before the optimizer steps,
    and nothing with non-finite weights is ever checkpointed or exported."""

    def __init__(self, step: int, what: str, value: float):
        # the text names inspect-data in its own fix line; .fix is the shorter one for reports
        super().__init__(f"the {what} became {value} at step {step}; stopping before the optimizer step, without "
                         "a checkpoint or export of this step\n"
                         "  fix: lower train.lr or raise train.warmup_steps, check the data (inspect-data), "
                         "and resume from the last checkpoint",
                         "lower train.lr or raise train.warmup_steps, check the data, resume from the last checkpoint")


@dataclass
class PendingStep:
    """A finished step whose numbers are still on the device (read on the next logging step)."""

    counts: torch.Tensor       # float64 [5], global: N_LOSS, N_REAL, AREA, SUM_SQ, STOP
    loss_sum: torch.Tensor     # 0-d, this rank's summed token loss
    grad_norm: torch.Tensor    # 0-d, global (pre-clip) norm
    n_micro: int               # micro-batches over all ranks
    epoch: int
    data_s: float
    compute_s: float


@dataclass
class StepStats:
    """A step's numbers on the host, global over ranks."""

    loss: float
    grad_norm: float
    n_loss: int
    n_real: int
    area: int
    sum_sq: int
    n_micro: int
    epoch: int
    data_s: float
    compute_s: float


@dataclass
class StepOutcome:
    pending: PendingStep
    stop_requested: bool       # some rank asked to stop (SIGTERM/SIGINT): checkpoint after this step


def local_counts(mbs: list[MicroBatch], stop: bool) -> list[float]:
    return [sum(m.n_loss for m in mbs), sum(m.n_real for m in mbs), sum(m.area for m in mbs),
            sum(sum(n * n for n in m.doc_lengths) for m in mbs), 1.0 if stop else 0.0]


def run_step(model, optimizer, scheduler, mbs: list[MicroBatch], *, device: torch.device, world: int,
             grad_clip: float, loss_chunk_tokens: int, stop: bool, step: int, epoch: int,
             data_s: float, readback=None) -> StepOutcome:
    """Forward/backward over this rank's micro-batches, clip, and step the optimizer unless the
    norm is non-finite. `readback(tensor) -> list[float]` is the step's one host sync."""
    readback = readback or (lambda t: t.tolist())
    started = time.perf_counter()
    counts = collectives.sum_across_ranks(local_counts(mbs, stop), device)
    # FSDP2 averages gradients over ranks; times `world` turns that average into the sum, so the
    # gradient is exactly d(sum of token losses)/d(theta) / global count.
    scale = (world / counts[N_LOSS].clamp(min=1)).float()
    local_sum = torch.zeros((), device=device)
    sync = getattr(model, "set_requires_gradient_sync", None)
    for k, mb in enumerate(mbs):
        if sync is not None:   # reduce-scatter once per step, on the last micro-batch, not after each one
            sync(k == len(mbs) - 1)
        ls = loss_sum(model, to_device(mb.inputs, device), mb.labels.to(device, non_blocking=True),
                      loss_chunk_tokens)
        (ls * scale).backward()
        local_sum += ls.detach()
    clip = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=device.type == "cuda")
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    stop_flag, norm = readback(torch.stack([counts[STOP], grad_norm.detach().double()]))
    if not math.isfinite(norm):   # the norm is global: every rank stops here together
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLoss(step, "gradient norm", norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    pending = PendingStep(counts=counts, loss_sum=local_sum, grad_norm=grad_norm.detach(),
                          n_micro=len(mbs) * world, epoch=epoch, data_s=data_s,
                          compute_s=time.perf_counter() - started)
    return StepOutcome(pending=pending, stop_requested=stop_flag > 0)


def read_interval(pending: list[PendingStep], device: torch.device, first_step: int) -> list[StepStats]:
    """The interval's steps on the host: one all-reduce of the loss sums, one read-back."""
    if not pending:
        return []
    n = len(pending)
    sums = collectives.sum_across_ranks(torch.stack([p.loss_sum for p in pending]), device)
    host = torch.cat([sums, torch.stack([p.counts for p in pending]).flatten(),
                      torch.stack([p.grad_norm.double() for p in pending])]).tolist()
    losses, flat, norms = host[:n], host[n:6 * n], host[6 * n:]
    stats = []
    for i, p in enumerate(pending):
        c = flat[5 * i:5 * i + 5]
        loss = losses[i] / max(c[N_LOSS], 1)
        if not math.isfinite(loss):
            raise NonFiniteLoss(first_step + i, "loss", loss)
        stats.append(StepStats(loss=loss, grad_norm=norms[i], n_loss=int(c[N_LOSS]), n_real=int(c[N_REAL]),
                               area=int(c[AREA]), sum_sq=int(c[SUM_SQ]), n_micro=p.n_micro, epoch=p.epoch,
                               data_s=p.data_s, compute_s=p.compute_s))
    return stats
