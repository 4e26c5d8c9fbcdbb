"""Load the tokenizer and the causal LM from a local HF directory (or a hub id), and build the
training model: on the meta device, activation checkpointing and FSDP2 applied
(distributed/parallelize.py), then each rank reads only its own shards (checkpoint/hf_safetensors.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from contracts.errors import FixableError
from entrypoint.checkpoint.hf_safetensors import load_sharded
from families import family_of_config, known_families, load_family, model_types_of
from families import runtime as family_runtime


class ModelError(FixableError):
    fix_in_str = True

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def resolve_attention(configured: str, lock_attn: str | None, device_type: str) -> str:
    """`auto`: what the image promises (its lock), on the device it was built for; sdpa
    otherwise. flash_attention_2 is the only one that honours packed boundaries, which verify
    has checked before training starts."""
    if configured != "auto":
        return configured
    if device_type == "cuda" and lock_attn:
        return lock_attn
    return "sdpa"


def _source(path: str) -> str:
    p = Path(path)
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelError(f"{p} has no config.json", "point model.path at a HF-format model directory")
    return path


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """trust_remote_code is always passed explicitly: left unset, transformers asks on stdin
    whether to run a folder's auto_map code, and a piped `y` would answer it."""
    # transformers here, not at import: a worker sets its signal handlers first (train.main), and the
    # launcher imports it inside the run's cache environment (preflight.build_corpus)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(_source(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load tokenizer from {path}: {exc}",
                         "mount a HF model/tokenizer directory and set model.path (or model.tokenizer)") from None
    if tok.chat_template is None:
        raise ModelError(f"tokenizer at {path} has no chat template",
                         "use an instruct tokenizer, or add chat_template to tokenizer_config.json")
    if tok.pad_token_id is None:
        # Padding only fills masked slots (labels -100, own dummy document), so any id works;
        # eos is the conventional choice.
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, *, attn_implementation: str, trust_remote_code: bool = False):
    """fp32 master weights on CPU; FSDP2 moves each rank's shard to the device and casts
    the gathered copy to the compute dtype."""
    from transformers import AutoModelForCausalLM  # as in load_tokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            _source(path), dtype=torch.float32, attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ModelError(f"cannot load model from {path}: {exc}",
                         "check model.path and model.attn_implementation (sdpa works everywhere)") from None
    model.config.use_cache = False
    return model


def build_on_meta(path: str, *, attn_implementation: str, trust_remote_code: bool = False):
    """The model's module tree on the meta device (no memory), every rank alike: FSDP2 wraps it, then
    each rank allocates and reads only its own shards (hf_checkpoint.load_sharded)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # as in load_tokenizer

    if not (Path(path) / "config.json").is_file():
        raise ModelError(f"model.path {path} is not a local model folder",
                         "download the model first (e.g. `hf download ORG/MODEL --local-dir /models/x`) and mount "
                         "that folder; every rank reads its own shards from it")
    try:
        config = AutoConfig.from_pretrained(_source(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load model config from {path}: {exc}", "check model.path") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                     dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (ValueError, ImportError) as exc:
        raise ModelError(f"cannot build the model of {path}: {exc}",
                         "check model.attn_implementation (sdpa works everywhere)") from None
    model.config.use_cache = False
    return model


def model_family(model):
    """The family whose facts (decoder layers, FSDP units, batch kwargs) fit this model, named by
    its config's model_type. verify has already refused a model no family of the image covers
    (its model_family row), so here that is a plain error, never a guess."""
    name = family_of_config(model.config, known_families())
    if name is None:
        raise ModelError(f"model_type {', '.join(model_types_of(model.config)) or '(none)'} belongs to no model "
                         f"family this image knows ({', '.join(known_families())})",
                         "train a model of one of those families, or add its family (families/<name>.yaml)")
    return load_family(name)


def rebuild_buffers(model, device: torch.device, family=None) -> None:
    """Buffers that are not weights (rotary inv_freq, Falcon-H1's muP vector) are computed, not
    loaded: after to_empty they hold garbage, so each rotary module is rebuilt from its config and
    its buffers copied over, and the family's own hook rebuilds the rest."""
    if family is not None and hasattr(family_runtime.hooks(family), "rebuild_buffers"):
        family_runtime.hooks(family).rebuild_buffers(model, device)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).data.copy_(buffer.to(device))


def sharded_model(cfg, *, attn: str, device, world: int):
    """(model, n_ac): built on the meta device, activation checkpointing, FSDP2 (or HSDP), then each
    rank allocates and reads only its own shards from the HF safetensors."""
    # FSDP on the ranks only: the launcher imports this module for the tokenizer
    from entrypoint.distributed.parallelize import apply_activation_checkpointing, apply_fsdp, build_mesh

    p = cfg.parallel
    model = build_on_meta(cfg.model.path, attn_implementation=attn, trust_remote_code=cfg.model.trust_remote_code)
    family = model_family(model)
    n_ac = apply_activation_checkpointing(model, p.activation_checkpoint, p.ac_every, family_name=family.name)
    apply_fsdp(model, build_mesh(device.type, world, p.dp_replicate), param_dtype=p.param_dtype,
               reduce_dtype=p.reduce_dtype, reshard_after_forward=p.reshard_after_forward, family_name=family.name)
    family_runtime.add_batch_kwargs(family, model)
    model.to_empty(device=device)
    load_sharded(model, cfg.model.path)
    rebuild_buffers(model, device, family)
    return model, n_ac
