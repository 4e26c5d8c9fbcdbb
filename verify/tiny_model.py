"""A tiny model of the image's family, built from a config (no hub download), same layer types."""
from __future__ import annotations

import importlib
from types import ModuleType

from verify.families import Family


def modeling_module(family: Family) -> ModuleType:
    """The transformers modeling module; importing it is what makes transformers pick kernels."""
    return importlib.import_module(family.modeling_module)


def tiny_config(family: Family, *, attn_implementation: str, **overrides):
    module = modeling_module(family)
    config_cls = getattr(module, family.config_class)
    config = config_cls(**{**family.tiny_config, **overrides})
    config._attn_implementation = attn_implementation
    return config


def build_tiny_model(family: Family, *, attn_implementation: str, device: str = "cpu", dtype=None,
                     seed: int = 0, **overrides):
    """Seeded, so two builds are identical; raises what transformers raises (e.g. ImportError for FA2)."""
    import torch

    module = modeling_module(family)
    config = tiny_config(family, attn_implementation=attn_implementation, **overrides)
    torch.manual_seed(seed)
    model = getattr(module, family.causal_lm_class)(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)


def layer_kinds(model) -> dict[int, str]:
    """layer index -> "full_attention" | "linear_attention" (GDN), from the model's own config."""
    return dict(enumerate(model.config.layer_types[: model.config.num_hidden_layers]))


def sample_documents(lengths, vocab_size: int, seed: int = 0):
    """Random token documents (labels = input_ids) for probes; deterministic per seed."""
    import torch

    from entrypoint.collate import Document

    gen = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(1, vocab_size, (n,), generator=gen).tolist()
        docs.append(Document(input_ids=ids, labels=list(ids)))
    return docs


def batch_to(batch: dict, device: str) -> dict:
    """Move tensors to `device`; python ints (max_length_q/k) stay as they are."""
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def model_dtype(device: str):
    """fp32 on CPU (float noise ~1e-6); bf16 on CUDA because flash-attn and fla's chunk kernel
    refuse fp32 ("ChunkGatedDeltaRuleFunction does not support float32")."""
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32
