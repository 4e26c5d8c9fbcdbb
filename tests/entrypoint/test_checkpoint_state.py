"""Every field read back from a checkpoint is validated (checkpoint/trainer_state.py): a checkpoint
whose state is not what a save writes is DAMAGED, named with its file and field, skipped by
resume=auto for the newest valid one, and refused (exit 2, before any rank) when a resume points
at it. Never a traceback, never a value used as it came."""
from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from entrypoint.checkpoint.dcp import MARKER, TRAINER_STATE, CheckpointError, newest_valid, read_state, step_dir_name
from tests.fixtures.checkpoints import edit_json, model_and_optimizer, save_checkpoints

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Valid checkpoints at steps 2 and 4, saved once; each test edits its own copy."""
    root = tmp_path_factory.mktemp("ckpt-state")
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    try:
        save_checkpoints(root / "checkpoints", [2, 4])
    finally:
        dist.destroy_process_group()
    return root / "checkpoints"


@pytest.fixture
def ckpts(saved, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    return root


def _set(path: str, value):
    """An edit that sets the dotted `path` ("sampler.position", "scheduler.base_lrs.0") to `value`."""
    def edit(data):
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    return edit


def _damaged(ckpts: Path, file: str, where: str) -> str:
    newest = ckpts / "step-00000004"
    with pytest.raises(CheckpointError) as info:
        read_state(newest)
    line = str(info.value).splitlines()[0]
    assert line.startswith("step-00000004 is damaged: " + file + ": " + where), line
    assert "Traceback" not in str(info.value) and info.value.fix
    # resume=auto takes the newest valid one; a resume pointed at this one is refused
    path, state = newest_valid(ckpts, "auto")
    assert path.name == "step-00000002" and state.step == 2
    with pytest.raises(CheckpointError):
        newest_valid(ckpts, str(newest))
    return line


def test_a_valid_checkpoint_reads_back_typed(ckpts):
    state = read_state(ckpts / "step-00000004")
    assert state.step == 4 and state.world_size == 1 and state.sampler.position == 4
    assert state.scheduler.to_torch()["_step_count"] == 5 and state.data_fingerprint.sha256 == "0123456789abcdef"


@pytest.mark.parametrize("step, problem", [
    (-4, "-4 is out of range (allowed: an integer >= 0"),
    (10 ** 18, "1000000000000000000, but the folder is step 4"),
    ("abc", "expected an integer, got str"),
    (2.5, "expected an integer, got float"),
    (True, "expected an integer, got bool"),
    (None, "required field is missing"),
    (3, "3, but the folder is step 4"),
])
def test_a_bad_step_is_damage_not_a_step(ckpts, step, problem):
    edit_json(ckpts / "step-00000004" / TRAINER_STATE, _set("step", step))
    assert problem in _damaged(ckpts, TRAINER_STATE, "step")


def _update(section: str, **values):
    return lambda d: d[section].update(values)


@pytest.mark.parametrize("edit, where, problem", [
    (_set("scheduler.last_epoch", 3), "scheduler.last_epoch", "but the checkpoint is step 4"),
    (_set("scheduler.base_lrs", [float("nan")]), "scheduler.base_lrs[0]", "nan is not a finite number"),
    (_set("scheduler.base_lrs", [float("inf")]), "scheduler.base_lrs[0]", "inf is not a finite number"),
    (_set("scheduler.base_lrs", [-0.5]), "scheduler.base_lrs", "negative or not finite"),
    (_set("scheduler.base_lrs", []), "scheduler.base_lrs", "is empty"),
    (_set("scheduler.lr_lambdas", [{"__class__": 1}]), "scheduler.lr_lambdas[0]", "not a plain attribute"),
    (_set("scheduler.optimizer", {}), "scheduler.optimizer", "unknown field"),   # LambdaLR setattr()s every key
    (_set("scheduler._step_count", True), "scheduler._step_count", "expected an integer, got bool"),
    (_set("sampler.position", 10 ** 6), "sampler.position", "more than 4 steps of at most 1"),
    (_set("sampler.position", -1), "sampler.position", "out of range"),
    (_set("sampler.scheme", "zigzag"), "sampler.scheme", "is not one of"),
    (_set("sampler.world_size", 0), "sampler.world_size", "out of range"),
    (_set("sampler.n_docs", 41), "sampler.n_docs", "but data_fingerprint says 40"),
    (_set("sampler.budget", 1024), "sampler.budget", "but the run's packing.budget is 512"),
    (_set("world_size", "1"), "world_size", "expected an integer, got str"),
    (_set("world_size", True), "world_size", "expected an integer, got bool"),
    (_set("world_size", 2), "world_size", "but the folder's marker says 1"),
    (_set("world_size", 10 ** 9), "world_size", "but the folder's marker says 1"),
    (_set("data_fingerprint.sha256", "0123456789ABCDEF"), "data_fingerprint.sha256", "is not valid here"),
    (_set("data_fingerprint.sha256", "0123"), "data_fingerprint.sha256", "is not valid here"),
    (_set("data_fingerprint.n_tokens", 1.5), "data_fingerprint.n_tokens", "expected an integer, got float"),
    (_set("eval.best_loss", float("inf")), "eval.best_loss", "not a finite number"),
    (_update("eval", best_loss=1.0, best_step=9), "eval.best_step", "is after step 4"),
    (_set("eval.since_best", -1), "eval.since_best", "out of range"),
    (_set("total_steps", 3), "step", "4 is past the run's total_steps 3"),
    (_set("complete", True), "complete", "but the run is at step 4 of 10"),
    (_set("early_stopped", 0), "early_stopped", "expected true or false"),
    (_update("run_config", **{"train.nonsense": 1}), "run_config.train.nonsense", "is not a key a checkpoint records"),
    (_update("run_config", **{"train.max_steps": "many"}), "run_config.train.max_steps", "expected an integer"),
    (_update("run_config", **{"packing.mode": "sideways"}), "run_config.packing.mode", "is not one of"),
    (_update("files", **{"__0_0.distcp": -5}), "files", "negative file size"),
    (_update("files", **{"../x": 5}), "files", "is not the name of a file"),
    (_set("max_step_items", 0), "max_step_items", "out of range"),
    (_set("surprise", {"deep": [1]}), "surprise", "unknown field"),
    (_set("line\nbreak\u2028", 1), "line\\nbreak\\u2028", "unknown field"),   # one line, whatever the key
    (lambda d: d.pop("sampler"), "sampler", "required field is missing"),
])
def test_every_other_field_is_checked(ckpts, edit, where, problem):
    edit_json(ckpts / "step-00000004" / TRAINER_STATE, edit)
    line = _damaged(ckpts, TRAINER_STATE, where + ": ")
    assert problem in line, line


@pytest.mark.parametrize("edit, problem", [
    (_set("step", 2), "step: 2, but the folder is step 4"),
    (_set("step", "4"), "step: expected an integer, got str"),
    (_set("world_size", 0), "world_size: 0 is out of range"),
    (_set("world_size", False), "world_size: expected an integer, got bool"),
    (lambda d: d.pop("world_size"), "world_size: required field is missing"),
    (lambda d: d.update(owner="mallory"), "owner: unknown field"),
    ('[{"step": 4, "world_size": 1}]', "(file): expected a mapping, got list"),
    ("[" * 100000 + "]" * 100000, "nests deeper than 16 levels"),
    ('{"step": 4, "world_size": 1', "its brackets or quotes do not balance"),
])
def test_the_marker_is_validated_too(ckpts, edit, problem):
    path = ckpts / "step-00000004" / MARKER
    if isinstance(edit, str):
        path.write_text(edit)
    else:
        edit_json(path, edit)
    assert problem in _damaged(ckpts, MARKER, "")


@pytest.mark.parametrize("raw", [b"[" * 100000, b"{" * 100000, b'{"step": ' + b"[" * 3000 + b"]" * 3000 + b"}",
                                 b"\xff\xfe", b"", b"1" * 5000, b"NaN"])
def test_unparseable_or_deeply_nested_state_is_damage_not_a_recursion_error(ckpts, raw):
    (ckpts / "step-00000004" / TRAINER_STATE).write_bytes(raw)
    _damaged(ckpts, TRAINER_STATE, "")


@pytest.mark.parametrize("edit, problem", [
    (_set("numpy.pos", True), "numpy.pos: expected an integer, got bool"),
    (_set("numpy.pos", 700), "numpy.pos: 700 is out of range"),
    (_set("numpy.keys", [1] * 623), "numpy.keys: holds 623 values"),
    (_set("python.internal.624", 625), "python.internal: ends in position 625"),
    (_set("python.gauss_next", "0.5"), "python.gauss_next: expected a number, got str"),
    (_set("torch", "AAAA"), "torch: Expected a CPUGeneratorImplState of size"),
    (_set("torch", base64.b64encode(bytes(5056)).decode()), "torch: Invalid mt19937 state"),
    (_set("format", 2), "format: 2 is not one of: 1"),
    (_set("cuda", base64.b64encode(bytes(12)).decode()), "cuda: 12 bytes, not a CUDA generator state"),
    (_set("cuda", base64.b64encode(bytes(8) + (6).to_bytes(8, "little")).decode()), "Philox offset"),
    (_set("cuda", "not base64!"), "cuda: "),
    (lambda d: d.pop("python"), "python: required field is missing"),
])
def test_rng_files_are_validated_before_any_generator_is_touched(ckpts, edit, problem):
    path = ckpts / "step-00000004" / "rng-rank0.json"
    edit_json(path, edit)
    _reseal(ckpts / "step-00000004")
    assert problem in _damaged(ckpts, "rng-rank0.json", "")


def _reseal(step_dir: Path) -> None:
    """An attacker rewrites the size manifest too: only content checks stop them."""
    from entrypoint.checkpoint.dcp import files_manifest

    edit_json(step_dir / TRAINER_STATE, lambda d: d.update(files=files_manifest(step_dir)))


def _edit_metadata(step_dir: Path, edit) -> None:
    from entrypoint.checkpoint.safe_load import MetadataUnpickler

    with (step_dir / ".metadata").open("rb") as fh:
        metadata = MetadataUnpickler(fh).load()
    edit(metadata)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(step_dir)


def _first_storage(metadata):
    index = next(iter(metadata.storage_data))
    return index, metadata.storage_data[index]


@pytest.mark.parametrize("edit, problem", [
    (lambda m: setattr(_first_storage(m)[1], "relative_path", "../../../etc/passwd"),
     "which is not a file name inside the checkpoint folder"),
    (lambda m: setattr(_first_storage(m)[1], "relative_path", "__9_9.distcp"), "which is not a file of the"),
    (lambda m: setattr(_first_storage(m)[1], "length", 10 ** 12), "lie outside __0_0.distcp"),
    (lambda m: setattr(_first_storage(m)[1], "offset", True), "lie outside"),
    (lambda m: setattr(m, "storage_data", [1, 2]), "storage_data is not a mapping"),
    (lambda m: setattr(m, "state_dict_metadata", {"x": 3}), "x: it is neither a tensor nor a bytes entry"),
])
def test_dcp_metadata_is_checked_as_data_before_dcp_reads_by_it(ckpts, edit, problem):
    _edit_metadata(ckpts / "step-00000004", edit)
    with pytest.raises(CheckpointError, match="step-00000004 was refused: .metadata: ") as info:
        read_state(ckpts / "step-00000004")
    assert problem in str(info.value)
    assert newest_valid(ckpts, "auto")[0].name == "step-00000002"


def test_the_checkpointer_refuses_a_damaged_state_before_loading_anything(ckpts, tmp_path):
    from entrypoint.checkpoint.dcp import Checkpointer

    edit_json(ckpts / "step-00000004" / TRAINER_STATE, _set("step", -4))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ckpt = Checkpointer(ckpts, keep=5, rank=0, world_size=1)
        model, optimizer = model_and_optimizer()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(CheckpointError, match="step-00000004 is damaged: trainer_state.json: step"):
            ckpt.load(ckpts / "step-00000004", model, optimizer)
        assert all((a == b).all() for a, b in zip(before, model.parameters()))
        assert ckpt.load(ckpts / "step-00000002", model, optimizer).step == 2
        with pytest.raises(ValueError, match="0 .. 99999999"):
            ckpt.save(-4, model, optimizer, {})
    finally:
        dist.destroy_process_group()
    assert step_dir_name(4) == "step-00000004"
    assert not [p for p in ckpts.iterdir() if "--" in p.name]


def test_a_resume_pointed_at_a_damaged_checkpoint_is_refused_with_exit_2(ckpts, tmp_path):
    from contracts.finetune_config import build_config
    from entrypoint.launcher.preflight import FinetuneError, preflight_resume

    out = tmp_path / "out"
    out.mkdir()
    os.rename(ckpts, out / "checkpoints")
    edit_json(out / "checkpoints" / "step-00000004" / TRAINER_STATE, _set("step", "abc"))
    cfg = build_config([{"output": {"dir": str(out)},
                         "checkpoint": {"resume": str(out / "checkpoints" / "step-00000004")}}], require_paths=False)
    with pytest.raises(FinetuneError) as info:
        preflight_resume(cfg, log=print)
    assert info.value.exit_code == 2 and "step-00000004 is damaged: trainer_state.json: step" in str(info.value)
    assert "checkpoint.resume" in info.value.fix


def test_state_files_round_trip_what_the_trainer_writes(ckpts):
    """to_dict is the JSON a save wrote (the launcher's view of a resumed state)."""
    written = json.loads((ckpts / "step-00000004" / TRAINER_STATE).read_text())
    assert read_state(ckpts / "step-00000004").to_dict() == {**written, "rng_note": ""}
