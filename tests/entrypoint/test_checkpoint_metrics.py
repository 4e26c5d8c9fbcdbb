"""Checkpoint validity rules and the packing-aware FLOP count (no processes)."""
from __future__ import annotations

import json
import os

import pytest

from entrypoint.checkpoint.dcp import MARKER, TRAINER_STATE, is_complete, list_checkpoints

pytestmark = pytest.mark.unit


def _complete(path, world=2):
    path.mkdir(parents=True)
    (path / MARKER).write_text("{}")
    (path / ".metadata").write_bytes(b"x")
    for r in range(world):
        (path / f"rng-rank{r}.json").write_bytes(b"{}")
    (path / TRAINER_STATE).write_text(json.dumps({"step": 1}))


def test_only_complete_step_dirs_count(tmp_path):
    _complete(tmp_path / "step-00000010")
    _complete(tmp_path / "step-00000002")
    _complete(tmp_path / ".tmp-step-00000012")          # complete contents, but not committed
    (tmp_path / "step-00000011").mkdir()                  # torn: no metadata / trainer state
    (tmp_path / "step-00000011" / ".metadata").write_bytes(b"x")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000010"]
    assert not is_complete(tmp_path / ".tmp-step-00000012")
    assert not is_complete(tmp_path / "step-00000010", world_size=3)  # a rank's RNG is missing
    assert list_checkpoints(tmp_path / "absent") == []


def test_symlinks_and_unmarked_folders_are_never_checkpoints(tmp_path):
    """A planted `step-*` symlink to another run's checkpoint, a `checkpoints` symlink, or a
    folder this tool did not make must never be resumed from or pruned."""
    other = tmp_path / "other-run"
    _complete(other / "step-00000050")
    root = tmp_path / "mine"
    _complete(root / "step-00000002")
    os.symlink(other / "step-00000050", root / "step-00000099")
    _complete(root / "step-00000003")
    (root / "step-00000003" / MARKER).unlink()                           # not made by this tool
    (root / "step-00000004").mkdir()
    for name in (MARKER, ".metadata", TRAINER_STATE):
        os.symlink(other / "step-00000050" / name, root / "step-00000004" / name)  # files through symlinks
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002"]
    os.symlink(other, tmp_path / "linked-root")
    assert list_checkpoints(tmp_path / "linked-root") == []


def test_flops_count_attention_per_document(fixture_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from entrypoint.observability.flops import flop_model

    config = AutoConfig.from_pretrained(str(fixture_dir.model_dir))
    model = AutoModelForCausalLM.from_config(config)
    fm = flop_model(model, config)
    n_full = config.layer_types.count("full_attention")
    assert fm.attn_per_sq_token == pytest.approx(n_full * 2 * config.num_attention_heads * config.head_dim)
    assert fm.gdn_per_token > 0
    embed = config.vocab_size * config.hidden_size
    matmul = sum(p.numel() for p in model.parameters() if p.dim() >= 2) - embed
    assert fm.dense_per_token == 2 * matmul
    # two packed documents of 100 tokens cost less attention than one row of 200
    assert fm.train_flops(200, 100**2 + 100**2) < fm.train_flops(200, 200**2)
    assert fm.train_flops(200, 2 * 100**2) - fm.train_flops(200, 0) == pytest.approx(3 * fm.attn_per_sq_token * 2e4)


def test_chunked_loss_equals_unchunked_in_value_and_gradient():
    import torch

    from entrypoint.loss import chunked_ce_sum

    torch.manual_seed(0)
    logits = torch.randn(37, 11, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 11, (37,))
    labels[::3] = -100
    full = chunked_ce_sum(logits, labels, 0)
    (g_full,) = torch.autograd.grad(full, logits)
    chunked = chunked_ce_sum(logits, labels, 8)   # 5 chunks, the last one short
    (g_chunked,) = torch.autograd.grad(chunked, logits)
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(g_chunked, g_full, rtol=0, atol=0)
    assert full.dtype == torch.float32


def test_a_short_write_on_a_full_volume_counts_as_a_full_disk(tmp_path, monkeypatch):
    # torch's zip writer reports a full disk as a position mismatch, not ENOSPC
    from collections import namedtuple

    from entrypoint.checkpoint.dcp import ran_out_of_space

    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("entrypoint.checkpoint.dcp.shutil.disk_usage", lambda _p: usage(3 << 20, 3 << 20, 4096))
    assert ran_out_of_space(short_write, tmp_path, needed_bytes=1 << 20)
    monkeypatch.setattr("entrypoint.checkpoint.dcp.shutil.disk_usage", lambda _p: usage(1 << 40, 0, 1 << 40))
    assert not ran_out_of_space(short_write, tmp_path, needed_bytes=1 << 20)
    assert ran_out_of_space(OSError(28, "No space left on device"), tmp_path, needed_bytes=1 << 20)


def test_the_background_checkpoint_write_yields_the_cpu_to_training(tmp_path, monkeypatch):
    # an async save's write runs on DCP's thread at a lower priority, and only there: the thread
    # that trains (here, the test's) keeps its own
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from entrypoint.checkpoint.dcp import BACKGROUND_NICE, BackgroundWriter

    seen = {}

    def fake_write(self, plan, planner):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return "written"

    monkeypatch.setattr(FileSystemWriter, "write_data", fake_write)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = BackgroundWriter(str(tmp_path))
    result = {}

    def background():
        result["first"] = (writer.write_data(None, None), seen["nice"])
        result["again"] = (writer.write_data(None, None), seen["nice"])   # DCP may reuse its thread

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    want = min(19, before + BACKGROUND_NICE)
    assert result["first"] == ("written", want) and result["again"] == ("written", want)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_refused_priority_change_never_stops_the_save(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from entrypoint.checkpoint.dcp import BackgroundWriter

    def refuse(*_args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(FileSystemWriter, "write_data", lambda self, plan, planner: "written")
    monkeypatch.setattr(os, "setpriority", refuse)
    assert BackgroundWriter(str(tmp_path)).write_data(None, None) == "written"
    monkeypatch.setattr(os, "getpriority", refuse)
    assert BackgroundWriter(str(tmp_path)).write_data(None, None) == "written"
