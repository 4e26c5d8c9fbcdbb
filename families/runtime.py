"""Models of a family, built from its flavours (no hub download): the torch side of families/.

Imported by verify/, entrypoint/, bench/ and the tests; never by build/.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from families import Family, with_batch_adds


def modeling_module(family: Family) -> ModuleType:
    """The transformers modeling module. Importing it is what makes transformers pick its
    kernels (once, at import), so import it only after the environment is final."""
    return importlib.import_module(family.modeling_module)


def hooks(family: Family) -> ModuleType:
    return importlib.import_module(family.hooks)


def model_config(family: Family, flavour: str = "tiny", *, attn_implementation: str, head_dim: int | None = None,
                 **overrides):
    config_cls = getattr(modeling_module(family), family.config_class)
    config = config_cls(**{**family.flavour(flavour, head_dim=head_dim), **overrides})
    config._attn_implementation = attn_implementation
    return config


def build_model(family: Family, flavour: str = "tiny", *, attn_implementation: str, device: str = "cpu",
                dtype=None, seed: int = 0, head_dim: int | None = None, **overrides):
    """Seeded, so two builds are identical; raises what transformers raises (e.g. ImportError
    when flash_attention_2 is asked for and flash_attn is unusable)."""
    config = model_config(family, flavour, attn_implementation=attn_implementation, head_dim=head_dim, **overrides)
    torch.manual_seed(seed)
    model = getattr(modeling_module(family), family.causal_lm_class)(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)


def decoder_layers(family: Family, model):
    node = model
    for part in family.decoder_layers.split("."):
        node = getattr(node, part)
    return node


def layer_kinds(family: Family, model) -> dict[int, tuple[str, ...]]:
    """layer index -> the family's layer kinds that layer holds, from the model's own config
    (`layer_types_key`); every kind in every layer where the family says so (Falcon-H1). A
    mixerless layer type (Nemotron-H's MoE and MLP blocks) holds none; any other type is an error."""
    n = model.config.num_hidden_layers
    if family.layer_types_key is None:
        return {i: tuple(family.layer_kinds) for i in range(n)}
    types = list(getattr(model.config, family.layer_types_key))[:n]
    unknown = sorted({t for t in types if t not in family.layer_kinds and t not in family.mixerless_layer_types})
    if unknown:
        # fail closed: a layer of a kind the family does not name would go unwatched and unprobed
        raise ValueError(f"the model's {family.layer_types_key} holds {', '.join(map(repr, unknown))}, which "
                         f"families/{family.name}.yaml names neither as a layer kind nor as mixerless")
    return {i: ((t,) if t in family.layer_kinds else ()) for i, t in enumerate(types)}


def mixer(family: Family, layer, kind: str):
    """The token mixer (attention or GDN module) of one decoder layer of `kind`."""
    inner = getattr(layer, "_checkpoint_wrapped_module", layer)
    return getattr(inner, family.layer_kinds[kind].module, None)


def probe_dtype(device: str):
    """fp32 on CPU (float noise ~1e-6); bf16 on CUDA, because flash-attn and fla's chunk kernel
    refuse fp32 ("ChunkGatedDeltaRuleFunction does not support float32")."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def add_batch_kwargs(family: Family, model) -> None:
    """Make every forward of `model` carry the family's `batch_adds` (e.g. Kimi Linear's
    cu_seqlens from the collated cu_seq_lens_q): the pinned modeling code never derives them,
    and its kernels leak packed documents without them. Only packed batches hold the source key,
    so an unpacked forward is unchanged."""
    if not family.batch_adds:
        return

    def add(module, args, kwargs):
        added = with_batch_adds(family, kwargs)
        return (args, added) if added is not kwargs else None

    model.register_forward_pre_hook(add, with_kwargs=True)

