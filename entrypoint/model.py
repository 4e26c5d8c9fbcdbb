"""Load the tokenizer and the causal LM from a local HF directory (or a hub id)."""
from __future__ import annotations

from pathlib import Path

import torch


class ModelError(Exception):
    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}\n  fix: {fix}")
        self.fix = fix


def resolve_attention(configured: str, lock_attn: str | None, device_type: str) -> str:
    """`auto`: what the image promises (its lock), on the device it was built for; sdpa
    otherwise. flash_attention_2 is the only one that honours packed boundaries (DESIGN
    part 1), which verify has checked before training starts."""
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
    from transformers import AutoModelForCausalLM

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


def load_model_for_sharding(path: str, *, attn_implementation: str, rank: int, world_size: int,
                            trust_remote_code: bool = False):
    """(model, full_state_dict). Only rank 0 reads the weights; the others build the
    same module tree on the meta device, so host memory holds ONE full fp32 copy per
    node instead of one per GPU (27B in fp32 is ~108 GB). `materialize` then fills every
    rank's shards from rank 0 after fully_shard."""
    if rank == 0 or world_size == 1:
        model = load_model(path, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
        # captured before activation-checkpoint wrappers rename submodules
        return model, (model.state_dict() if world_size > 1 else None)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(_source(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load model config from {path}: {exc}", "check model.path") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.config.use_cache = False
    return model, {}


def materialize(model, full_state_dict: dict | None, device: torch.device) -> None:
    """After fully_shard: allocate meta shards and copy rank 0's weights into every rank's
    shards; buffers (not sharded, e.g. rotary inv_freq, which is not in the state dict)
    are broadcast whole."""
    if full_state_dict is None:
        return
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=device)
    set_model_state_dict(model, full_state_dict,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():
        staged = buf.data.to(device)  # nccl broadcasts device tensors only
        dist.broadcast(staged, src=0)
        buf.data.copy_(staged)
