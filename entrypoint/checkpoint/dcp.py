"""DCP checkpoints written atomically, resumed exactly, and read as data only.

Layout under <output.dir>/checkpoints/ (a real folder, never a symlink):
  step-00000010/          a complete checkpoint (the ONLY name resume ever considers)
    .ftimage-checkpoint    marker: this folder was made by a run of this tool (written first)
    .metadata, __*.distcp  model + optimizer (DCP, sharded, every rank writes its part)
    rng-rank<r>.json       per-rank RNG state (torch, cuda, numpy, python) as JSON
    trainer_state.json     step, scheduler, sampler, the run's resume-sensitive config, and the
                           size of every file above; written LAST
  .tmp-step-00000012/     being written; never valid; removed at the next start

Atomicity: all ranks write into the temp dir, every file is fsynced, then rank 0 renames the
temp dir to its final name and fsyncs the parent. rename(2) is atomic on one filesystem, so a
kill at any moment leaves either a complete step dir or a temp dir. A step dir damaged later
(a truncated shard, or any field of its state files that is not what a save writes: see
trainer_state.py) is DAMAGED: read_state says which file and field, resume=auto skips it for the
newest valid one, and a resume pointed at it is refused. A full disk is one error naming the
path and the space a checkpoint needs.
Multi-node runs need output.dir on a shared filesystem.

Nothing here runs code from a checkpoint: RNG and trainer state are JSON, and DCP's pickled
metadata and bytes entries go through dcp_safe. Listing and pruning never follow symlinks,
and pruning deletes only real step folders holding the marker.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from contracts import atomic
from contracts.errors import FixableError, headline
from contracts.folder_guard import is_real_dir, is_real_file, real_dir
from entrypoint.checkpoint import rng_state
from entrypoint.checkpoint import trainer_state as ts
from entrypoint.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpoint
from entrypoint.checkpoint.trainer_state import MARKER, TRAINER_STATE, TrainerState
from entrypoint.distributed.collectives import barrier

STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(FixableError):
    fix_in_str = True

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


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
    return {p.name: os.lstat(p).st_size for p in sorted(path.iterdir())
            if is_real_file(p) and p.name not in (TRAINER_STATE, MARKER)}


def state_bytes(*trees) -> int:
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
    if type(step) is not int or not 0 <= step < 10 ** 8:
        raise ValueError(f"a checkpoint step is an int in 0 .. 99999999, not {step!r}")
    return f"step-{step:08d}"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.json"


def is_complete(path: Path, world_size: int | None = None) -> bool:
    """A real step folder made by this tool, with its metadata and trainer state (no symlinks)."""
    if not (STEP_DIR.match(path.name) and is_real_dir(path)):
        return False
    if not all(is_real_file(path / name) for name in (MARKER, ".metadata", TRAINER_STATE)):
        return False
    if world_size is not None:
        return all(is_real_file(path / rng_file(r)) for r in range(world_size))
    return True


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first. A `checkpoints` that is a symlink holds none."""
    if not is_real_dir(root):
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=step_of)


def read_state(path: Path, *, ranks=None, param_groups: int | None = None) -> TrainerState:
    """The validated state of a complete checkpoint (trainer_state.py): its marker and trainer state,
    typed and checked against each other, the folder and the run; its files at their recorded
    sizes; the RNG files of `ranks` (every rank that saved when None) and DCP's metadata read as
    data. Anything else raises CheckpointError naming the checkpoint, the file and the field (resume=auto
    then moves on to the next newest)."""
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint",
                              "set checkpoint.resume=auto (newest complete one), never, or a complete "
                              "step-* directory")
    try:
        state = ts.read_states(path, step_of(path), param_groups)
        actual = files_manifest(path)
        damaged = [f"{name} ({actual.get(name, 'missing')} bytes, recorded {size})"
                   for name, size in state.files.items() if actual.get(name) != size]
        if damaged:
            raise CheckpointError(f"{path.name} is damaged: {', '.join(damaged[:3])}", ts.DAMAGED_FIX)
        ts.read_contents(path, state, ranks)
    except ts.StateRefused as exc:
        raise CheckpointError(f"{path.name} was refused: {exc}", ts.REFUSED_FIX) from None
    except ts.StateInvalid as exc:
        raise CheckpointError(f"{path.name} is damaged: {exc}", ts.DAMAGED_FIX) from None
    except OSError as exc:
        raise CheckpointError(f"{path.name} is unreadable: {exc}", ts.DAMAGED_FIX) from None
    return state


def resume_candidates(root: Path, mode: str) -> list[Path]:
    """What checkpoint.resume points at, newest first: auto = every complete step-* (the first valid
    one wins), never = none, else that one folder."""
    if mode == "never":
        return []
    return list(reversed(list_checkpoints(root))) if mode == "auto" else [Path(mode)]


def newest_valid(root: Path, mode: str) -> tuple[Path, TrainerState] | None:
    for path in resume_candidates(root, mode):
        try:
            return path, read_state(path)
        except CheckpointError:
            if mode != "auto":
                raise
    return None


@dataclass
class InFlight:
    """An async save: its data is being written; it becomes step-* only once every rank's is."""

    step: int
    tmp: Path
    final: Path
    future: object
    trainer_state: dict
    protect: int | None
    started: float
    bytes: int


BACKGROUND_NICE = 10    # added to the training thread's nice value (capped at 19)


class BackgroundWriter(FileSystemWriter):
    """DCP's file writer for async saves, run at a lower CPU priority than training.

    The write runs on DCP's background thread; serialising and copying gigabytes there competes
    with the training step for the same cores (the launch thread on a GPU host, the math itself on
    CPU ranks). A nice value is per thread on Linux and inherited by the threads it starts, so
    only the save yields: it takes a little longer, the steps it overlaps do not."""

    def __init__(self, path: str):
        super().__init__(path)
        # made on the training thread: the save runs BACKGROUND_NICE below it, however often
        # DCP reuses its background thread
        try:
            self.nice = min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + BACKGROUND_NICE)
        except OSError:
            self.nice = None    # a seccomp profile refusing it: the save runs at the training priority

    def write_data(self, plan, planner):
        if self.nice is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:
                pass    # refused: the save still runs, at the training thread's priority
        return super().write_data(plan, planner)


class Checkpointer:
    """Saves step folders (synchronously, or with DCP's async save: the state is staged to host
    memory, training goes on, and the folder is committed once the write completed on every
    rank) and loads them back (read_state/load)."""

    def __init__(self, root: Path, *, keep: int, rank: int, world_size: int, device: torch.device | None = None,
                 asynchronous: bool = False, log=None, grace_seconds: int | None = None):
        self.root = root
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.asynchronous = asynchronous
        self.log = log or (lambda _m: None)
        self.inflight: InFlight | None = None
        self.grace_seconds = grace_seconds
        # the background writer's collectives must not share the training group's (NCCL) stream
        self.async_group = dist.new_group(backend="gloo") if asynchronous else None

    def barrier(self) -> None:
        barrier(self.device)

    def clean_stale(self) -> list[str]:
        """Remove temp dirs a killed run left behind (rank 0; then everyone waits). Only real
        folders holding this tool's marker: nothing else under output.dir is ever deleted."""
        removed = []
        if self.rank == 0 and is_real_dir(self.root):
            for p in self.root.iterdir():
                if p.name.startswith(atomic.TMP_PREFIX) and is_real_dir(p) and is_real_file(p / MARKER):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
        self.barrier()
        return removed

    def save(self, step: int, model, optimizer, trainer_state: dict, protect: int | None = None, *,
             wait: bool = False) -> Path:
        """Write step `step` (all ranks); prune to the newest `keep`, never deleting step `protect`
        (the best eval's checkpoint, checkpoint.keep_best). With async saves, returns once the state
        is staged (`wait` forces a synchronous save, e.g. the one a stop request asks for)."""
        self.wait()   # one save in flight at a time; a stop request waits for it, then saves its own
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{atomic.TMP_PREFIX}{final.name}"
        if self.rank == 0:
            self.root.parent.mkdir(parents=True, exist_ok=True)   # output.dir, resolved by the launcher
            real_dir(self.root)
            if is_real_dir(tmp) and is_real_file(tmp / MARKER):
                shutil.rmtree(tmp)
            os.mkdir(tmp, 0o755)          # fails on a planted file or symlink of that name
            atomic.write_json(tmp / MARKER, {"step": step, "world_size": self.world_size})
        self.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        size = state_bytes(model_sd, optim_sd) * self.world_size
        started = time.perf_counter()
        try:
            atomic.write_json(tmp / rng_file(self.rank), rng_state.capture())
            if self.asynchronous and not wait:
                future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                                        storage_writer=BackgroundWriter(str(tmp)), process_group=self.async_group)
                self.inflight = InFlight(step, tmp, final, future, trainer_state, protect, started, size)
                self.log(f"checkpoint step {step}: state staged in {time.perf_counter() - started:.1f}s, written in "
                         "the background while training goes on")
                return final
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        except (OSError, RuntimeError, CheckpointException) as exc:
            self._failed(exc, tmp, size)
        self.barrier()
        self._commit(InFlight(step, tmp, final, None, trainer_state, protect, started, size))
        self.barrier()
        return final

    def _failed(self, exc: BaseException, tmp: Path, size: int):
        if ran_out_of_space(exc, tmp, size):
            shutil.rmtree(tmp, ignore_errors=True)   # give the space back; resume never sees a partial step
            raise disk_full(tmp, size) from None
        raise exc

    def poll(self) -> None:
        """Commit the async save in flight if its write has completed (at a step boundary)."""
        if self.inflight is not None and self.inflight.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the async save in flight is written, then commit it."""
        if self.inflight is None:
            return
        inflight, self.inflight = self.inflight, None
        try:
            inflight.future.result()
        except (OSError, RuntimeError, CheckpointException) as exc:
            self._failed(exc, inflight.tmp, inflight.bytes)
        self._commit(inflight)

    def _commit(self, saved: InFlight) -> None:
        """Rank 0 makes the folder a checkpoint: trainer_state.json (written last), rename, prune.
        Its DCP write completing means every rank's did: DCP's coordinator gathers all ranks' write
        results before it writes .metadata."""
        if self.rank != 0:
            return
        state = {**saved.trainer_state, "world_size": self.world_size, "files": files_manifest(saved.tmp)}
        atomic.write_json(saved.tmp / TRAINER_STATE, state)
        atomic.fsync_tree(saved.tmp)
        if is_complete(saved.final):   # a re-run of the same step after resume: replace it whole
            shutil.rmtree(saved.final)
        os.rename(saved.tmp, saved.final)
        atomic.fsync_dir(self.root)
        self._prune(saved.protect)
        on_disk = sum(p.stat().st_size for p in saved.final.iterdir() if p.is_file())
        took = time.perf_counter() - saved.started
        self.log(f"checkpoint step {saved.step} committed in {took:.1f}s ({on_disk / 2 ** 30:.2f} GiB)")
        if self.grace_seconds and 2 * took > self.grace_seconds:
            self.log(f"WARNING: a stop waits for a save in flight and then saves again (~{2 * took:.0f}s), more than "
                     f"launch.stop_grace_seconds={self.grace_seconds}: raise it (and the pods' grace period)")

    def _prune(self, protect: int | None = None) -> None:
        for old in list_checkpoints(self.root)[:-self.keep]:
            if step_of(old) != protect:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer) -> TrainerState:
        """Restore model + optimizer in place; returns the trainer state (RNG restored too). Every
        rank checks the state and its own RNG file first, and all agree before DCP reads a byte:
        one rank's damaged file makes every rank refuse the checkpoint, none half-loads it."""
        verdict = None
        try:
            state = read_state(path, ranks=[self.rank], param_groups=len(optimizer.param_groups))
        except CheckpointError as exc:
            verdict = (headline(exc), exc.fix)
        verdicts = [verdict]
        if dist.is_initialized() and dist.get_world_size() > 1:
            verdicts = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, verdict)
        refused = next((v for v in verdicts if v), None)
        if refused:
            raise CheckpointError(*refused)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        try:
            reader = SafeFileSystemReader(str(path))
            reader.read_metadata()   # refused here, by name, before DCP folds the reason into its own error
            dcp.load(loaded, storage_reader=reader, planner=SafeLoadPlanner())
        except (UnsafeCheckpoint, ValueError) as exc:
            raise CheckpointError(f"{path.name} was refused: {str(exc).splitlines()[0]}", ts.REFUSED_FIX) from None
        except CheckpointException as exc:
            unsafe = [e for e in _causes(exc) if isinstance(e, UnsafeCheckpoint)]
            if unsafe:
                raise CheckpointError(f"{path.name} was refused: {unsafe[0]}", ts.REFUSED_FIX) from None
            raise
        if self.rank in state.rng:
            rng_state.apply(state.rng[self.rank])   # parsed and trial-applied by read_state: cannot fail
        else:   # saved by fewer ranks than this run has (DCP reshards the weights; RNG cannot be)
            state.rng_note = (f"{path.name} holds no RNG state for rank {self.rank} (it was saved by "
                              f"{state.world_size} ranks); this rank's RNG continues from train.seed")
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        return state


def _causes(exc: CheckpointException) -> list[BaseException]:
    """DCP wraps each rank's failure; dig the originals out."""
    found = []
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        found.append(getattr(inner, "exception", inner))
    return found
