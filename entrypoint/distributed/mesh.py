"""The device mesh a run will use, and what each GPU holds: checked before any rank starts.

Flat FSDP shards the training state over every rank. HSDP (parallel.dp_replicate > 1) keeps
dp_replicate copies, each sharded over world / dp_replicate ranks: the all-gathers and
reduce-scatters stay inside a replica (a node, on NVLink), and only one all-reduce of the
gradient shards crosses the slower links between replicas, once per step.

Per GPU, the persistent state is 16 bytes per parameter over the shard group: the fp32 master
copy (4), its fp32 gradient (4) and Adam's two moments (8). Activations, the gathered bf16
parameters of the unit being computed and the allocator's slack come on top.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import FixableError

STATE_BYTES_PER_PARAM = 16
FIT_FRACTION = 0.8   # what the state may take of a GPU: the rest is activations, gathered units, slack


class MeshError(FixableError):
    fix_in_str = True

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


@dataclass(frozen=True)
class MeshPlan:
    world: int
    replicate: int
    shard: int
    n_params: int | None
    gpu_bytes: int | None

    @property
    def state_bytes(self) -> int | None:
        return None if self.n_params is None else self.n_params * STATE_BYTES_PER_PARAM // self.shard

    def render(self) -> str:
        layout = (f"HSDP: {self.replicate} replicas x {self.shard} shards" if self.replicate > 1
                  else f"flat FSDP over {self.shard} ranks")
        line = f"mesh: {self.world} ranks, {layout}"
        if self.state_bytes is not None:
            line += (f"; per-GPU state ~{self.state_bytes / 2 ** 30:.2f} GiB ({self.n_params / 1e6:.1f}M params x "
                     f"{STATE_BYTES_PER_PARAM} B / {self.shard} shards)")
        if self.gpu_bytes:
            line += f" of {self.gpu_bytes / 2 ** 30:.1f} GiB per GPU"
        return line


def count_params(model_dir: Path) -> int | None:
    """Parameters in a local HF checkpoint, from the safetensors headers (nothing is loaded)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for dim in info["shape"]:
                    n *= int(dim)
                total += n
    return total


def gpu_memory() -> int | None:
    try:   # torch only when a GPU is measured: the launcher plans the mesh (preflight) before it needs torch
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


def mesh_plan(cfg, world: int, *, check_fit: bool = False) -> MeshPlan:
    replicate = cfg.parallel.dp_replicate
    if world % replicate:
        raise MeshError(f"parallel.dp_replicate={replicate} does not divide the world size {world}",
                        f"use a divisor of {world} (e.g. the number of nodes), or 1 for flat FSDP")
    model_dir = Path(cfg.model.path)
    plan = MeshPlan(world=world, replicate=replicate, shard=world // replicate,
                    n_params=count_params(model_dir) if model_dir.is_dir() else None, gpu_bytes=gpu_memory())
    if check_fit and plan.gpu_bytes and plan.state_bytes and plan.state_bytes > FIT_FRACTION * plan.gpu_bytes:
        raise MeshError(f"the training state needs ~{plan.state_bytes / 2 ** 30:.1f} GiB per GPU "
                        f"({plan.n_params / 1e9:.2f}B params x {STATE_BYTES_PER_PARAM} B / {plan.shard} shards), "
                        f"over {FIT_FRACTION:.0%} of the GPU's {plan.gpu_bytes / 2 ** 30:.1f} GiB",
                        "shard over more ranks: lower parallel.dp_replicate, or add GPUs/nodes")
    return plan
