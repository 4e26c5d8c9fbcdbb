"""The hybrid families (GDN, KDA, short-conv and Mamba2 layers beside attention): each family file
loads (which checks it against the installed transformers' modeling source), its tiny flavour
trains one step on a packed row as the trainer feeds it, every layer kind it names is built at
least twice, and its bench flavour is a config the config class accepts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from contracts.collate import IGNORE_INDEX, Document, collate_packed
from families import load_family
from families import runtime as family_runtime

pytestmark = pytest.mark.unit

FAMILIES = ("qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear", "lfm2",
            "granitemoehybrid", "nemotron_h", "falcon_h1")
DOC_LENGTHS = (23, 17, 9)    # three documents and the collator's padding document in one row
BUDGET = 56
MAX_TINY_PARAMS = 2_000_000


def packed_row(vocab_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    docs = []
    for n in DOC_LENGTHS:
        ids = torch.randint(1, vocab_size, (n,), generator=generator).tolist()
        docs.append(Document(input_ids=ids, labels=list(ids)))
    return collate_packed(docs, budget=BUDGET, pad_token_id=0)


def model_inputs(family, batch: dict) -> dict:
    """What the trainer hands the model: the collated row without labels, plus the family's
    batch_adds (kwargs the pinned modeling code never derives from the collated boundaries)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    for kwarg, key in family.batch_adds.items():
        inputs[kwarg] = batch[key]
    return inputs


def record_boundaries(family, monkeypatch) -> dict[str, list[set[str]]]:
    """Wrap each fused wrapper of the modeling module to record the kwargs each call passes."""
    module = family_runtime.modeling_module(family)
    seen: dict[str, list[set[str]]] = {}
    for fused in family.fused_functions:
        original = getattr(module, fused.wrapper)

        def recording(*args, _original=original, _name=fused.wrapper, **kwargs):
            seen.setdefault(_name, []).append(set(kwargs))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, fused.wrapper, recording)
    return seen


def layer_kind_counts(family, model) -> dict[str, int]:
    module = family_runtime.modeling_module(family)
    layers = family_runtime.decoder_layers(family, model)
    return {name: sum(isinstance(getattr(layer, kind.module, None), getattr(module, kind.layer_class))
                      for layer in layers)
            for name, kind in family.layer_kinds.items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_family_file_loads_and_names_its_config_classes_model_type(name):
    family = load_family(name)      # reading it runs families/source_check.py against transformers
    config_class = getattr(family_runtime.modeling_module(family), family.config_class)
    assert config_class.model_type in family.model_types
    assert family.hooks == f"families.{name}" and family.dtypes == ("bf16",)
    for flavour in ("tiny", "probe", "bench"):
        assert flavour in family.flavours


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tiny_flavour_trains_a_step_on_a_packed_row_with_every_layer_kind_twice(name, monkeypatch):
    family = load_family(name)
    seen = record_boundaries(family, monkeypatch)
    model = family_runtime.build_model(family, "tiny", attn_implementation="sdpa")
    assert sum(p.numel() for p in model.parameters()) < MAX_TINY_PARAMS
    counts = layer_kind_counts(family, model)
    assert all(n >= 2 for n in counts.values()), counts
    hooks = family_runtime.hooks(family)
    for layer in family_runtime.decoder_layers(family, model):
        for modules, policy in hooks.fsdp_groups(layer):
            assert modules and policy in ("compute", "fp32")

    batch = packed_row(model.config.vocab_size)
    model.train()
    logits = model(**model_inputs(family, batch), use_cache=False).logits
    assert logits.shape == (1, BUDGET, model.config.vocab_size)
    labels = batch["labels"]
    loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=IGNORE_INDEX)
    loss.backward()
    assert torch.isfinite(loss)
    # the training forward called every fused wrapper, each with its boundary kwarg (the torch
    # fallbacks behind them drop it; the kernels take it)
    for fused in family.fused_functions:
        assert seen.get(fused.wrapper), f"{fused.wrapper} was not called"
        assert all(fused.boundary_kwarg in kwargs for kwargs in seen[fused.wrapper]), (fused.wrapper, seen)
    # every token mixer got a gradient
    module = family_runtime.modeling_module(family)
    for layer in family_runtime.decoder_layers(family, model):
        for kind in family.layer_kinds.values():
            mixer = getattr(layer, kind.module, None)
            if isinstance(mixer, getattr(module, kind.layer_class)):
                grads = [p.grad for p in mixer.parameters()]
                assert grads and all(g is not None and torch.isfinite(g).all() for g in grads), kind.layer_class


@pytest.mark.parametrize("name", FAMILIES)
def test_the_probe_flavour_runs_attention_at_the_compiled_head_dim_and_its_hook_prepares_it(name):
    family = load_family(name)
    model = family_runtime.build_model(family, "probe", attn_implementation="sdpa")
    module = family_runtime.modeling_module(family)
    attention = next(kind for kind in family.layer_kinds.values() if kind.measure == ("attention",))
    layers = [getattr(layer, attention.module) for layer in family_runtime.decoder_layers(family, model)
              if isinstance(getattr(layer, attention.module, None), getattr(module, attention.layer_class))]
    # MLA (Kimi) states its query/key head dim as qk_head_dim; the others as head_dim
    assert {getattr(a, "head_dim", None) or a.qk_head_dim for a in layers} == {family.attention.head_dims[0]}

    decays = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("A_log")}
    prepared = family_runtime.hooks(family).prepare_probe_model(model)
    assert prepared is model and not model.training
    after = dict(model.named_parameters())
    # every recurrent decay was set small (A = exp(A_log) <= 0.5); the short conv (LFM2) has none
    assert all(not torch.equal(decays[n], after[n]) and after[n].exp().max() <= 0.5 + 1e-6 for n in decays)
    # a Mamba2 mixer's skip path (D * x) is off, so its output is the state path a leak would cross
    assert all(not p.any() for n, p in after.items() if n.endswith(".D"))
    with torch.no_grad():
        logits = model(**model_inputs(family, packed_row(model.config.vocab_size)), use_cache=False).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_bench_flavour_is_a_config_the_config_class_accepts(name):
    family = load_family(name)
    config = family_runtime.model_config(family, "bench", attn_implementation="flash_attention_2")
    assert config.vocab_size == 32768 and config.num_hidden_layers == 4
    if family.layer_types_key is not None:
        types = list(getattr(config, family.layer_types_key))
        assert set(family.layer_kinds) <= set(types), types
        assert set(types) <= set(family.layer_kinds) | set(family.mixerless_layer_types), types

