"""Every family's checkpoint in and out, as transformers writes and reads it.

transformers 5 saves a model under its checkpoint names (per-expert MoE weights, Granite's
`router.layer`, Nemotron-H's `backbone.`) and converts them as it loads. For each family: a tiny
model saved with save_pretrained is read by our sharded load (meta, FSDP2, each rank its own part)
into exactly the weights from_pretrained gives, and our export of it is what from_pretrained loads
back, in the source's own layout, tensor for tensor. Run as a script under torchrun, this file is
the two-rank side of test_moe_families_on_two_ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from families import known_families

REPO = Path(__file__).resolve().parents[2]
# the families whose tiny checkpoint transformers reads under the model's own names
NO_CONVERSIONS = {"falcon_h1", "lfm2", "qwen3_5_text"}
# on two ranks: per-expert tensors stacked (each rank reads its own experts), a concatenation along
# the sharded dim (Kimi Linear's q/k/v conv1d), renamed prefixes (Nemotron-H's backbone.)
TWO_RANKS = ("qwen3_5_moe", "kimi_linear", "nemotron_h")


class _Tokenizer:
    def save_pretrained(self, path: str) -> None:   # the export writes the tokenizer; no tokenizer here
        pass


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _source(directory: Path, family: str) -> Path:
    from families import load_family
    from families.runtime import build_model

    build_model(load_family(family), "tiny", attn_implementation="sdpa").save_pretrained(str(directory))
    return directory


def _sharded(source: Path, world: int):
    """The training model as a rank builds it (entrypoint.model.sharded_model): meta, activation
    checkpointing, FSDP2, to_empty, load_sharded."""
    from entrypoint.model import sharded_model

    cfg = SimpleNamespace(
        model=SimpleNamespace(path=str(source), trust_remote_code=False),
        parallel=SimpleNamespace(activation_checkpoint="full", ac_every=1, dp_replicate=1, param_dtype="float32",
                                 reduce_dtype="float32", reshard_after_forward=True))
    model, _ = sharded_model(cfg, attn="sdpa", device=torch.device("cpu"), world=world)
    return model


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _export(model, source: Path, out: Path) -> None:
    from entrypoint.checkpoint.hf_safetensors import export

    export(model, model.config, _Tokenizer(), source, out, dtype=torch.float32, rank=dist.get_rank(),
           barrier=dist.barrier)


def _from_pretrained(path: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()


def _names_on_disk(path: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            names |= set(fh.keys())
    return names


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def _assert_exported(source: Path, out: Path, reference: dict) -> None:
    _assert_same(_from_pretrained(out), reference)
    assert _names_on_disk(out) == _names_on_disk(source)   # the source's own layout, nothing copied aside
    assert json.loads((out / "export_info.json").read_text()) == {"copied_through": []}


@pytest.mark.unit
@pytest.mark.parametrize("family", known_families())
def test_family_checkpoint_loads_sharded_and_exports_back(family, tmp_path, process_group):
    from entrypoint.checkpoint.hf_conversions import load_plan
    from entrypoint.checkpoint.hf_safetensors import check_source

    source = _source(tmp_path / "source", family)
    reference = _from_pretrained(source)
    model = _sharded(source, world=1)
    _assert_same(_full_state(model), reference)

    plan = load_plan(model, list(check_source(source)), list(reference))
    if family in NO_CONVERSIONS:   # read as before: every tensor under its own name, through DCP
        assert not plan.used and not plan.converted and all(k == v for k, v in plan.renamed.items())
    else:
        assert plan.used

    out = tmp_path / "export"
    _export(model, source, out)
    _assert_exported(source, out, reference)


def _rewrite(source: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})


def _drop(name: str):
    return lambda tensors: tensors.pop(name)


def _replace(name: str, *shape: int):
    return lambda tensors: tensors.update({name: torch.zeros(shape)})


@pytest.mark.unit
@pytest.mark.parametrize("family, change, message", [
    ("qwen3_5_moe", _drop("model.layers.1.mlp.experts.3.up_proj.weight"),
     r"experts\.gate_up_proj.*3 tensor\(s\) matching mlp\.experts\.\*\.up_proj\.weight.*4 experts"),
    ("nemotron_h", _drop("backbone.norm_f.weight"), r"lacks 1 tensor\(s\) the model needs, e\.g\. model\.norm_f"),
    ("granitemoehybrid", _replace("model.layers.0.block_sparse_moe.router.layer.weight", 3, 64),
     r"router\.layer\.weight \(the model's model\.layers\.0\.block_sparse_moe\.router\.weight\) has shape \[3, 64\]"),
    ("kimi_linear", _replace("model.layers.0.self_attn.k_conv1d.weight", 5, 1, 4),
     r"self_attn\.conv1d\.weight, made of 3 tensor\(s\).* has shape \[133, 1, 4\], but the model needs \[192, 1, 4\]"),
    ("olmo_hybrid", _replace("model.layers.2.linear_attn.v_conv1d.weight", 84, 1, 3),
     r"layers\.2\.linear_attn\.conv1d\.weight, made of 3 tensor\(s\).* which do not fit together"),
])
def test_a_checkpoint_that_does_not_fit_is_one_clear_error(family, change, message, tmp_path, process_group):
    from entrypoint.checkpoint.hf_safetensors import SourceCheckpointError

    source = _source(tmp_path / "source", family)
    _rewrite(source, change)
    with pytest.raises(SourceCheckpointError, match=message) as err:
        _sharded(source, world=1)
    assert "point model.path at the checkpoint this config belongs to" in str(err.value)


@pytest.mark.training
def test_moe_families_on_two_ranks(tmp_path):
    """FSDP2 over two gloo ranks: each rank reads its part (its own experts, its slice of a
    concatenation), the whole equals from_pretrained's, and the export written by both ranks loads back."""
    for family in TWO_RANKS:
        _source(tmp_path / family / "source", family)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, str(tmp_path), *TWO_RANKS], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for family in TWO_RANKS:
        source = tmp_path / family / "source"
        reference = _from_pretrained(source)
        _assert_same(torch.load(tmp_path / family / "loaded.pt"), reference)
        _assert_exported(source, tmp_path / family / "export", reference)


def _two_ranks(root: Path, families: list[str]) -> None:
    """One rank of test_moe_families_on_two_ranks: load each family's source sharded, hand the
    whole back to the test (rank 0), export it from both ranks."""
    dist.init_process_group("gloo")
    try:
        for family in families:
            model = _sharded(root / family / "source", world=dist.get_world_size())
            state = _full_state(model)
            if dist.get_rank() == 0:
                torch.save(state, root / family / "loaded.pt")
            _export(model, root / family / "source", root / family / "export")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _two_ranks(Path(sys.argv[1]), sys.argv[2:])
