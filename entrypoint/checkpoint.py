"""DCP checkpoints written atomically, resumed exactly, and the final HF export.

Layout under <output.dir>/checkpoints/:
  step-00000010/          a complete checkpoint (the ONLY name resume ever considers)
    .metadata, __*.distcp  model + optimizer (DCP, sharded, every rank writes its part)
    rng-rank<r>.pt         per-rank RNG state (torch, cuda, numpy, python)
    trainer_state.json     step, scheduler, sampler, and the size of every file above, written LAST
  .tmp-step-00000012/     being written; never valid; removed at the next start

Atomicity: all ranks write into the temp dir, every file is fsynced, then rank 0 renames
the temp dir to its final name and fsyncs the parent. rename(2) is atomic on one
filesystem, so a kill at any moment leaves either a complete step dir or a temp dir.
A step dir damaged later (a truncated shard) fails its size manifest and is skipped by
resume=auto, which takes the newest valid one. A full disk is one error naming the path
and the space a checkpoint needs. Multi-node runs need output.dir on a shared filesystem.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer_state.json"


class CheckpointError(Exception):
    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}\n  fix: {fix}")
        self.fix = fix


class DiskFull(CheckpointError):
    """No space left while writing a checkpoint or the export (reported once, by rank 0)."""


def disk_full(path: Path, needed_bytes: int) -> DiskFull:
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        free = 0
    return DiskFull(f"no space left on the device while writing {path}: it needs about "
                    f"{needed_bytes / 2 ** 30:.1f} GiB, {free / 2 ** 30:.1f} GiB are free",
                    "free space on that volume, lower checkpoint.keep, or point output.dir at a larger volume")


def ran_out_of_space(exc: BaseException, path: Path, needed_bytes: int) -> bool:
    """Whether a failed write was a full disk. ENOSPC is not always what surfaces: torch's zip
    writer reports a short write as "unexpected pos N vs M", and dcp wraps each rank's error
    in its own exception. So the volume itself is asked too: less free space than the write
    needed means it was full."""
    if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc):
        return True
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        return False
    return free < needed_bytes


def files_manifest(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != TRAINER_STATE}


def _state_bytes(*trees) -> int:
    total = 0
    for tree in trees:
        stack = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                stack.extend(node.values())
            elif isinstance(node, (list, tuple)):
                stack.extend(node)
            elif torch.is_tensor(node):
                local = getattr(node, "to_local", None)
                tensor = local() if local else node
                total += tensor.numel() * tensor.element_size()
    return total


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path, world_size: int | None = None) -> bool:
    if not (STEP_DIR.match(path.name) and (path / ".metadata").is_file() and (path / TRAINER_STATE).is_file()):
        return False
    if world_size is not None:
        return all((path / f"rng-rank{r}.pt").is_file() for r in range(world_size))
    return True


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    def __init__(self, root: Path, *, keep: int, rank: int, world_size: int, device: torch.device | None = None):
        self.root = root
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.device = device or torch.device("cpu")

    def barrier(self) -> None:
        from entrypoint.collectives import barrier

        barrier(self.device)

    def clean_stale(self) -> list[str]:
        """Remove temp dirs a killed run left behind (rank 0; then everyone waits)."""
        removed = []
        if self.rank == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
        self.barrier()
        return removed

    def save(self, step: int, model, optimizer, trainer_state: dict) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
            torch.save(rng_state(), tmp / f"rng-rank{self.rank}.pt")
        except (OSError, RuntimeError, CheckpointException) as exc:
            needed = _state_bytes(model_sd, optim_sd) * self.world_size
            if ran_out_of_space(exc, tmp, needed):
                shutil.rmtree(tmp, ignore_errors=True)   # give the space back; resume never sees a partial step
                raise disk_full(tmp, needed) from None
            raise
        self.barrier()
        if self.rank == 0:
            state = {**trainer_state, "files": files_manifest(tmp)}
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
            _fsync_tree(tmp)
            if final.exists():  # a re-run of the same step after resume: replace it whole
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer) -> dict:
        """Restore model + optimizer in place; returns trainer_state (rng restored too)."""
        if not is_complete(path, self.world_size):
            raise CheckpointError(f"{path} is not a complete checkpoint for {self.world_size} ranks",
                                  "set checkpoint.resume=auto (newest complete one), never, or a complete "
                                  "step-* directory written by the same world size")
        try:
            recorded = json.loads((path / TRAINER_STATE).read_text()).get("files", {})
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}/{TRAINER_STATE} is unreadable: {exc}", "resume from another checkpoint") \
                from None
        actual = files_manifest(path)
        damaged = [f"{name} ({actual.get(name, 'missing')} bytes, recorded {size})"
                   for name, size in recorded.items() if actual.get(name) != size]
        if damaged:
            raise CheckpointError(f"{path.name} is damaged: {', '.join(damaged[:3])}",
                                  "resume=auto skips it and takes the newest valid checkpoint; delete it to reclaim "
                                  "the space")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        set_rng_state(torch.load(path / f"rng-rank{self.rank}.pt", weights_only=False))
        return json.loads((path / TRAINER_STATE).read_text())


def export_hf(model, hf_config, tokenizer, out_dir: Path, *, dtype: torch.dtype, rank: int) -> Path | None:
    """Gather full weights to rank 0 and write a from_pretrained-loadable directory
    (safetensors, sharded at 5 GB), atomically like checkpoints."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    from huggingface_hub import save_torch_state_dict

    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if getattr(hf_config, "tie_word_embeddings", False):
        full.pop("lm_head.weight", None)  # shared with the embedding; HF re-ties on load
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    try:
        save_torch_state_dict(state, str(tmp), max_shard_size="5GB")
        hf_config.dtype = str(dtype).removeprefix("torch.")
        hf_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _fsync_tree(tmp)
    except (OSError, RuntimeError) as exc:
        needed = _state_bytes(state)
        full = ran_out_of_space(exc, tmp, needed)   # asked before the partial files are removed
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(out_dir, needed) from None
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    _fsync_dir(out_dir.parent)
    return out_dir
