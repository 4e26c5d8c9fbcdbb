"""At scale, as torchtitan does it, proven on the tiny hybrid: HSDP equals flat FSDP, gradients are
reduced once per step, the export is a drop-in replacement for the source, async checkpoints
survive a kill, and a run resumes on a different world size."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from entrypoint.checkpoint.dcp import is_complete, list_checkpoints
from tests.fixtures.chat import REPO, entrypoint_env, run_entrypoint

pytestmark = pytest.mark.training


def _finetune(fixture_dir, out: Path, *overrides: str, config: Path | None = None, timeout: float = 300):
    return run_entrypoint(["finetune", "--config", str(config or fixture_dir.config), "--allow-fallback",
                           f"output.dir={out}", *overrides], timeout=timeout)


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in rows if m.get("kind", "train") == "train"}


def test_hsdp_2x2_equals_flat_fsdp_in_fp32(fixture_dir, tmp_path):
    common = ("launch.nproc_per_node=4", "train.max_steps=3", "output.log_every=1", "checkpoint.every=0",
              "checkpoint.export=false", "parallel.reduce_dtype=float32")
    flat = _finetune(fixture_dir, tmp_path / "flat", *common)
    hsdp = _finetune(fixture_dir, tmp_path / "hsdp", *common, "parallel.dp_replicate=2")
    assert flat.returncode == 0 and hsdp.returncode == 0, flat.stderr[-2000:] + hsdp.stderr[-2000:]
    assert "HSDP 2 replicas x 2 shards" in hsdp.stdout and "FSDP2 over 4 ranks" in flat.stdout
    a, b = _metrics(tmp_path / "flat"), _metrics(tmp_path / "hsdp")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-6)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], abs=1e-6)

    bad = _finetune(fixture_dir, tmp_path / "bad", *common, "parallel.dp_replicate=3")
    assert bad.returncode == 2 and "parallel.dp_replicate=3 does not divide the world size 4" in bad.stderr


def _grads_worker(rank: int, world: int, init: str, sync_every: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from entrypoint.distributed.parallelize import build_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=build_mesh("cpu", world))
    fully_shard(model, mesh=build_mesh("cpu", world))
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * rank + k)) for k in range(3)]
    for k, x in enumerate(batches):
        model.set_requires_gradient_sync(sync_every or k == len(batches) - 1)
        model(x).pow(2).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out)
    dist.barrier()
    # as the trainer does (entrypoint/train.py): skip C++ static destructors, where a joinable
    # gloo thread can abort a process that finished its work
    os._exit(0)


def test_reducing_gradients_once_per_step_gives_the_same_gradient(tmp_path):
    import torch.multiprocessing as mp

    results = {}
    for sync_every in (True, False):
        out = tmp_path / f"grads-{sync_every}.pt"
        mp.spawn(_grads_worker, args=(2, f"file://{tmp_path}/pg-{sync_every}", sync_every, str(out)), nprocs=2)
        results[sync_every] = torch.load(out, weights_only=True)
    for name, grad in results[True].items():
        torch.testing.assert_close(results[False][name], grad, rtol=0, atol=1e-6, msg=name)


def _source_with_extras(fixture_dir, root: Path) -> Path:
    """The fixture model as a two-shard checkpoint with tensors the training model does not hold
    (Qwen3.5's mtp.* weights) and a generation_config.json: what a real release looks like."""
    from safetensors.torch import load_file, save_file

    model = root / "model"
    shutil.copytree(fixture_dir.model_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    names = sorted(weights)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    torch.manual_seed(7)
    extras = {"mtp.layers.0.fc.weight": torch.randn(16, 16), "mtp.norm.weight": torch.ones(16)}
    save_file({k: weights[k] for k in first}, str(model / "model-00001-of-00002.safetensors"))
    save_file({**{k: weights[k] for k in second}, **extras}, str(model / "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in [*second, *extras]}}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "do_sample": True,
                                                              "temperature": 0.6, "top_p": 0.95}))
    import yaml

    config = yaml.safe_load(fixture_dir.config.read_text())
    config["model"]["path"] = str(model)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return model


def test_the_export_is_a_drop_in_replacement_for_the_source(fixture_dir, tmp_path):
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    source = _source_with_extras(fixture_dir, tmp_path)
    out = tmp_path / "out"
    r = _finetune(fixture_dir, out, "train.max_steps=2", "checkpoint.every=1", "checkpoint.export_every=1",
                  "checkpoint.export_dtype=float32", config=tmp_path / "config.yaml")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    final = out / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]
    source_index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(source_index)                      # the source's tensor names, all of them
    assert sorted(set(index.values()) - {"model-extra.safetensors"}) == sorted(set(source_index.values()))
    assert json.loads((final / "export_info.json").read_text())["copied_through"] == [
        "mtp.layers.0.fc.weight", "mtp.norm.weight"]
    config = json.loads((final / "config.json").read_text())
    assert config["use_cache"] is True
    assert json.loads((final / "generation_config.json").read_text()) == json.loads(
        (source / "generation_config.json").read_text())
    assert "chat_template" in (final / "tokenizer_config.json").read_text() or (final / "chat_template.jinja").is_file()

    def tensor(folder: Path, name: str, weight_map: dict) -> torch.Tensor:
        with safe_open(str(folder / weight_map[name]), "pt") as fh:
            return fh.get_tensor(name)

    for name in ("mtp.layers.0.fc.weight", "mtp.norm.weight"):   # copied through bit for bit
        assert torch.equal(tensor(final, name, index), tensor(source, name, source_index))
    dcp_to_torch_save(str(list_checkpoints(out / "checkpoints")[-1]), str(tmp_path / "ckpt.pt"))
    reference = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]   # the gathered reference
    for name, value in reference.items():
        assert torch.equal(tensor(final, name, index), value), name

    loaded = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    check = AutoModelForCausalLM.from_pretrained(str(source)).eval()
    check.load_state_dict(reference, strict=False)
    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 31]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, check(input_ids=ids).logits, rtol=0, atol=1e-5)
        generated = loaded.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert generated.past_key_values is not None   # use_cache is back on
    assert (out / "exports" / "step-00000001" / "model.safetensors.index.json").is_file()

    r = run_entrypoint(["finetune", "export", "--config", str(tmp_path / "config.yaml"), "--checkpoint",
                        "step-00000002", f"output.dir={out}", "checkpoint.export_dtype=float32",
                        "launch.nproc_per_node=1"], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    again = out / "exports" / "step-00000002"
    for name in reference:
        assert torch.equal(tensor(again, name, index), tensor(final, name, index)), name


@pytest.mark.parametrize("fault", ["missing_shard", "truncated", "index_names_nothing"])
def test_a_broken_source_checkpoint_is_one_error_before_any_rank(fixture_dir, tmp_path, fault):
    source = _source_with_extras(fixture_dir, tmp_path)
    if fault == "missing_shard":
        (source / "model-00002-of-00002.safetensors").unlink()
    elif fault == "truncated":
        shard = source / "model-00001-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 100])
    else:
        index = json.loads((source / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
    r = _finetune(fixture_dir, tmp_path / "out", config=tmp_path / "config.yaml", timeout=120)
    assert r.returncode == 2 and "fix:" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert {"missing_shard": "not in", "truncated": "truncated", "index_names_nothing": "not in"}[fault] in r.stderr
    assert not (tmp_path / "out" / ".launch").exists()    # refused before any rank started


def _kill_tree(pid: int) -> None:
    from entrypoint.launcher.supervise import descendants

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_kill_during_async_checkpoints_leaves_valid_ones_and_resume_is_exact(fixture_dir, tmp_path):
    common = ("train.max_steps=10", "checkpoint.every=1", "checkpoint.keep=20", "checkpoint.async=true",
              "checkpoint.export=false", "output.log_every=1")
    base = _finetune(fixture_dir, tmp_path / "base", *common)
    assert base.returncode == 0, base.stderr[-3000:]
    assert "written in the background" in base.stdout and "committed in" in base.stdout
    want = {s: m["loss"] for s, m in _metrics(tmp_path / "base").items()}

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "entrypoint", "finetune", "--config", str(fixture_dir.config),
                             "--allow-fallback", f"output.dir={out}", *common], cwd=REPO, env=entrypoint_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (out / "metrics.jsonl").exists() or max(_metrics(out), default=0) < 5:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    _kill_tree(proc.pid)     # checkpoints are written every step: the kill lands on one in flight or near it
    proc.wait(timeout=30)
    for p in (out / "checkpoints").iterdir():
        if p.name.startswith("step-"):
            assert is_complete(p, world_size=2), f"{p} is named as a checkpoint but incomplete"
    resume_step = int(list_checkpoints(out / "checkpoints")[-1].name.split("-")[1])
    r = _finetune(fixture_dir, out, *common)
    assert r.returncode == 0, r.stderr[-3000:]
    got = _metrics(out)
    assert sorted(got) == list(range(1, 11))
    for step in range(resume_step + 1, 11):
        assert got[step]["loss"] == pytest.approx(want[step], abs=1e-4), step


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_on_a_different_world_size(fixture_dir, tmp_path, before, after):
    out = tmp_path / "out"
    r = _finetune(fixture_dir, out, f"launch.nproc_per_node={before}", "train.max_steps=3", "checkpoint.every=3",
                  "checkpoint.export=false")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _finetune(fixture_dir, out, f"launch.nproc_per_node={after}", "train.max_steps=5",
                  "checkpoint.allow_changed=[train.max_steps]", "checkpoint.export=false")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"was saved by {before} ranks and resumes on {after}" in r.stdout
    if after > before:
        assert "holds no RNG state for rank 1" in r.stderr
    report = json.loads((out / "run_report.json").read_text())
    assert report["final_step"] == 5 and report["world_size"] == after
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in _metrics(out).values())
