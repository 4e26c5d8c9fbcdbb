"""A checkpoint folder on a shared volume is writable by others: nothing in it may run as code,
and nothing outside the run's own folders may be written, followed or deleted."""
from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from contracts.folder_guard import UnsafeFolder
from entrypoint.checkpoint.dcp import TRAINER_STATE, Checkpointer, CheckpointError, files_manifest, list_checkpoints
from tests.fixtures.checkpoints import model_and_optimizer as _model_and_optimizer
from tests.fixtures.checkpoints import trainer_state

pytestmark = pytest.mark.unit


class Payload:
    """What an attacker plants: unpickling it runs a command that leaves a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _saved(tmp_path) -> tuple[Checkpointer, Path]:
    ckpt = Checkpointer(tmp_path / "out" / "checkpoints", keep=2, rank=0, world_size=1)
    model, optimizer = _model_and_optimizer()
    return ckpt, ckpt.save(3, model, optimizer, trainer_state(3))


def _reseal(step_dir: Path) -> None:
    """An attacker can rewrite the size manifest too: only content checks may stop them."""
    state = json.loads((step_dir / TRAINER_STATE).read_text())
    state["files"] = files_manifest(step_dir)
    (step_dir / TRAINER_STATE).write_text(json.dumps(state))


def _resume(ckpt: Checkpointer, step_dir: Path):
    model, optimizer = _model_and_optimizer()
    return ckpt.load(step_dir, model, optimizer)


def test_a_pickled_rng_file_is_never_loaded(group, tmp_path):
    ckpt, step_dir = _saved(tmp_path)
    marker = tmp_path / "pwned-rng"
    (step_dir / "rng-rank0.pt").write_bytes(pickle.dumps(Payload(marker)))   # the name earlier releases loaded
    _reseal(step_dir)
    assert _resume(ckpt, step_dir).step == 3
    assert not marker.exists()
    (step_dir / "rng-rank0.json").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(step_dir)
    with pytest.raises(CheckpointError, match="step-00000003 is damaged: rng-rank0.json: it is not JSON"):
        _resume(ckpt, step_dir)
    assert not marker.exists()


def test_a_payload_in_dcp_metadata_is_refused(group, tmp_path):
    ckpt, step_dir = _saved(tmp_path)
    marker = tmp_path / "pwned-metadata"
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(step_dir)
    with pytest.raises(CheckpointError, match="not checkpoint metadata") as info:
        _resume(ckpt, step_dir)
    assert "posix.system" in str(info.value) and "fix:" in str(info.value)
    assert not marker.exists()


def test_a_payload_in_a_dcp_bytes_entry_is_refused(group, tmp_path):
    """Non-tensor entries (the optimizer's hyper-parameters) are stored as torch.save bytes; DCP's
    own planner loads them with weights_only=False."""
    from entrypoint.checkpoint.safe_load import MetadataUnpickler

    ckpt, step_dir = _saved(tmp_path)
    marker = tmp_path / "pwned-bytes"
    with (step_dir / ".metadata").open("rb") as fh:
        metadata = MetadataUnpickler(fh).load()
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    (step_dir / "__evil.distcp").write_bytes(buffer.getvalue())
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(relative_path="__evil.distcp", offset=0, length=len(buffer.getvalue()))
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(step_dir)
    with pytest.raises(CheckpointError, match="is not plain data"):
        _resume(ckpt, step_dir)
    assert not marker.exists()


def test_a_checkpoints_symlink_to_another_run_is_neither_resumed_nor_written_nor_pruned(group, tmp_path):
    other, step_dir = _saved(tmp_path / "other")
    theirs = sorted(p.name for p in step_dir.parent.iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    os.symlink(step_dir.parent, mine / "checkpoints")
    assert list_checkpoints(mine / "checkpoints") == []
    ckpt = Checkpointer(mine / "checkpoints", keep=1, rank=0, world_size=1)
    model, optimizer = _model_and_optimizer()
    with pytest.raises(UnsafeFolder, match="is a symlink"):
        ckpt.save(9, model, optimizer, trainer_state(9))
    assert sorted(p.name for p in step_dir.parent.iterdir()) == theirs
    assert ckpt.clean_stale() == []


def test_prune_deletes_only_marked_real_step_folders(group, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpts", keep=1, rank=0, world_size=1)
    model, optimizer = _model_and_optimizer()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    (tmp_path / "ckpts").mkdir()
    os.symlink(victim, tmp_path / "ckpts" / "step-00000001")          # planted, oldest by name
    (tmp_path / "ckpts" / "step-00000002").mkdir()                     # a folder this tool did not make
    (tmp_path / "ckpts" / ".tmp-step-00000003").mkdir()                # an unmarked temp-looking folder
    for step in (4, 5):
        ckpt.save(step, model, optimizer, trainer_state(step))
    assert [p.name for p in list_checkpoints(tmp_path / "ckpts")] == ["step-00000005"]
    assert (victim / "keep.txt").read_text() == "mine"
    assert (tmp_path / "ckpts" / "step-00000002").is_dir()
    ckpt.clean_stale()
    assert (tmp_path / "ckpts" / ".tmp-step-00000003").is_dir()


def test_metrics_are_never_appended_through_a_symlink(tmp_path):
    from entrypoint.observability.trackers import Metrics

    target = tmp_path / "victim.log"
    target.write_text("theirs\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(target, out / "metrics.jsonl")
    writer = Metrics(out, enabled=True)
    with pytest.raises(UnsafeFolder, match="is a symlink"):
        writer.write({"step": 1, "loss": 1.0})
    assert target.read_text() == "theirs\n"


class _Python3112Pickler(pickle.Pickler):
    """Pickles an enum member as Python 3.11.0-3.11.3 do (Debian 12's 3.11.2, the image's Python):
    getattr(TheEnum, "MEMBER"), where later releases write TheEnum(value)."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _repickle(step_dir: Path, metadata) -> None:
    buffer = io.BytesIO()
    _Python3112Pickler(buffer).dump(metadata)
    (step_dir / ".metadata").write_bytes(buffer.getvalue())
    _reseal(step_dir)


def test_metadata_pickled_by_the_image_s_python_resumes(group, tmp_path):
    from entrypoint.checkpoint.safe_load import MetadataUnpickler

    ckpt, step_dir = _saved(tmp_path)
    with (step_dir / ".metadata").open("rb") as fh:
        metadata = MetadataUnpickler(fh).load()
    _repickle(step_dir, metadata)
    assert b"getattr" in (step_dir / ".metadata").read_bytes()
    assert _resume(ckpt, step_dir) is not None


def test_a_getattr_in_metadata_reaching_anything_but_an_enum_member_is_refused(group, tmp_path):
    from torch.distributed.checkpoint import metadata as md

    class Reach:
        def __reduce__(self):
            return getattr, (md.Metadata, "__init__")

    ckpt, step_dir = _saved(tmp_path)
    (step_dir / ".metadata").write_bytes(pickle.dumps(Reach()))
    _reseal(step_dir)
    with pytest.raises(CheckpointError, match="not a member of a checkpoint metadata enum"):
        _resume(ckpt, step_dir)
