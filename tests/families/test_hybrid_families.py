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

FAMILIES = ("qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear", "lfm2")
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
def test_the_tiny_flavour_trains_a_step_on_a_packed_row_with_every_layer_kind_twice(name):
    family = load_family(name)
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
    # every token mixer got a gradient
    for layer in family_runtime.decoder_layers(family, model):
        for kind in family.layer_kinds.values():
            mixer = getattr(layer, kind.module, None)
            if mixer is not None:
                grads = [p.grad for p in mixer.parameters()]
                assert grads and all(g is not None and torch.isfinite(g).all() for g in grads), kind.layer_class


@pytest.mark.parametrize("name", FAMILIES)
def test_the_probe_flavour_runs_attention_at_the_compiled_head_dim(name):
    family = load_family(name)
    config = family_runtime.model_config(family, "probe", attn_implementation="sdpa")
    module = family_runtime.modeling_module(family)
    attention = next(kind for kind in family.layer_kinds.values() if kind.measure == ("attention",))
    layer = getattr(module, attention.layer_class)(config, layer_idx=_first_attention_layer(family, config))
    q_head_dim = getattr(layer, "head_dim", None) or layer.qk_head_dim
    assert q_head_dim == family.attention.head_dims[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_bench_flavour_is_a_config_the_config_class_accepts(name):
    family = load_family(name)
    config = family_runtime.model_config(family, "bench", attn_implementation="flash_attention_2")
    assert config.vocab_size == 32768 and config.num_hidden_layers == 4
    if family.layer_types_key is not None:
        types = list(getattr(config, family.layer_types_key))
        assert set(family.layer_kinds) <= set(types), types
        assert set(types) <= set(family.layer_kinds) | set(family.mixerless_layer_types), types


def _first_attention_layer(family, config) -> int:
    if family.layer_types_key is None:
        return 0
    kind = next(name for name, k in family.layer_kinds.items() if k.measure == ("attention",))
    return list(getattr(config, family.layer_types_key)).index(kind)
