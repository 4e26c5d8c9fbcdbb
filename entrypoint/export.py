"""The HF export: a from_pretrained-loadable folder (safetensors), written atomically like
checkpoints and never through a symlink under output.dir."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from contracts import atomic
from entrypoint.checkpoint import disk_full, ran_out_of_space, state_bytes
from entrypoint.rundir import is_real_dir


def export_hf(model, hf_config, tokenizer, out_dir: Path, *, dtype: torch.dtype, rank: int) -> Path | None:
    """Gather full weights to rank 0 and write a from_pretrained-loadable directory
    (safetensors, sharded at 5 GB), atomically like checkpoints."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    from huggingface_hub import save_torch_state_dict

    if out_dir.is_symlink() or (out_dir.exists() and not is_real_dir(out_dir)):
        from entrypoint.rundir import RunDirError

        raise RunDirError(f"{out_dir} is a symlink or a file; the export is only written into real folders",
                          f"remove {out_dir}, or use a fresh output.dir")
    tmp = atomic.staging_dir(out_dir.parent, out_dir.name)
    if getattr(hf_config, "tie_word_embeddings", False):
        full.pop("lm_head.weight", None)  # shared with the embedding; HF re-ties on load
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    try:
        save_torch_state_dict(state, str(tmp), max_shard_size="5GB")
        hf_config.dtype = str(dtype).removeprefix("torch.")
        hf_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        atomic.publish_dir(tmp, out_dir, replace=True)
    except (OSError, RuntimeError) as exc:
        needed = state_bytes(state)
        full = ran_out_of_space(exc, tmp, needed)   # asked before the partial files are removed
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(out_dir, needed) from None
        raise
    return out_dir
