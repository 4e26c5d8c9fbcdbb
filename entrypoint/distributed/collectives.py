"""Every collective the trainer itself issues, on tensors on the training device.

NCCL has no CPU backend: an all-reduce of a CPU tensor in a NCCL-only process group raises
"No backend type associated with device type cpu" at the first step. So the values a step
agrees on (token counts, the stop request, the interval's losses) are built on the training
device, and the process group also gets gloo for CPU tensors that torch's own helpers (DCP's
planning, the checkpoint barrier's object collectives) send.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """cuda:nccl for the training tensors, cpu:gloo for the small CPU collectives DCP issues."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def init_distributed(timeout_minutes: int) -> tuple[int, int, torch.device]:
    """The process group, with the configured collective timeout (launch.timeout_minutes)."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group(backend_for(device), device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend_for(device), timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def sum_across_ranks(values: list[float] | torch.Tensor, device: torch.device,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Element-wise sum over all ranks, as a tensor on `device`. No host sync: the result stays on
    the device until the caller reads it. float64 keeps token counts exact below 2^53."""
    tensor = values.to(device=device, dtype=dtype) if torch.is_tensor(values) else \
        torch.tensor(values, dtype=dtype, device=device)
    dist.all_reduce(tensor)
    return tensor


def max_across_ranks(values: list[float], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any (a stop request): the ranks decide together.
    A host sync, and a barrier."""
    return bool(max_across_ranks([1.0 if flag else 0.0], device)[0].item())


def barrier(device: torch.device) -> None:
    """A barrier that runs on the training device's backend (NCCL's barrier otherwise guesses
    a device from the rank, which is wrong when LOCAL_RANK does not map to it)."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
