"""Hugging Face safetensors in and out, sharded: no rank ever holds the whole model.

Load (torchtitan's way): the model is built on the meta device on every rank, wrapped in
activation checkpointing and FSDP2, then each rank reads only its own shards straight from the
safetensors files through DCP's Hugging Face storage reader. bf16 on disk is upcast into the fp32
sharded master copy as it is read.

Export: every rank writes its part through DCP's Hugging Face storage writer, which then
consolidates the parts into standard shards named as the source's were, with
model.safetensors.index.json. Rank 0 adds what makes the folder a drop-in replacement for the
source: the tensors the training model does not hold, copied through unchanged (Qwen3.5's
`mtp.*` multi-token-prediction weights, used for speculative decoding), the source's
generation_config.json, config.json with use_cache back on, and the tokenizer with its chat
template. The folder is written aside and renamed into place whole.

The source is checked before any rank allocates the model: an index naming a file that does not
exist, a missing shard, a truncated safetensors file or a malformed header (any field of it:
safetensors_header.py) is one clear error naming the file and the tensor.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open

from contracts import atomic
from contracts.errors import FixableError
from contracts.folder_guard import UnsafeFolder, is_real_dir
from entrypoint.checkpoint import json_limits
from entrypoint.checkpoint.safetensors_header import HEADER_LIMIT, MALFORMED_FIX, HeaderError, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SourceCheckpointError(FixableError):
    fix_in_str = True

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def _header(path: Path) -> dict:
    """A safetensors file's header, every field checked (safetensors_header.py): a truncated file or
    a malformed header is one SourceCheckpointError naming the file and the tensor."""
    try:
        return read_header(path)
    except HeaderError as exc:
        raise SourceCheckpointError(str(exc), exc.fix) from None
    except OSError as exc:
        raise SourceCheckpointError(f"{path} is unreadable: {exc.strerror or exc}", "copy the model again") from None


def _weight_map(index: Path) -> dict[str, str]:
    try:
        if index.stat().st_size > HEADER_LIMIT:
            raise ValueError(f"more than {HEADER_LIMIT} bytes")
        weight_map = json_limits.loads(index.read_bytes(), 4)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceCheckpointError(f"{index} is unreadable: {str(exc)[:200]}", MALFORMED_FIX) from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise SourceCheckpointError(f"{index}: weight_map is not an object of tensor name -> file name", MALFORMED_FIX)
    return weight_map


def weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it, for a checked source folder."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        files = {}
        for name, file in _weight_map(index).items():
            path = model_dir / file
            if "/" in file or file.startswith(".") or not path.is_file():
                raise SourceCheckpointError(f"{index} names {file} (for {name}), which is not in {model_dir}",
                                            "copy every shard of the model; the index lists them")
            files[name] = path
        return files
    single = model_dir / SINGLE
    if not single.is_file():
        raise SourceCheckpointError(f"{model_dir} has no {SINGLE} and no {INDEX}",
                                    "point model.path at a folder with the model's safetensors weights")
    return dict.fromkeys(_header(single), single)


def check_source(model_dir: Path) -> dict[str, Path]:
    """Every shard present and whole; returns the weight map. Raises SourceCheckpointError."""
    files = weight_files(model_dir)
    headers = {path: _header(path) for path in set(files.values())}
    for name, path in files.items():
        if name != "__metadata__" and name not in headers[path]:
            raise SourceCheckpointError(f"{path.name} does not hold {name}, which the index says it does",
                                        "copy the model again; the index and its shards disagree")
    return {k: v for k, v in files.items() if k != "__metadata__"}


def load_sharded(model, model_dir: Path) -> None:
    """Fill an FSDP2-sharded model (materialized with to_empty) from the source's safetensors, each
    rank reading only its own slices."""
    # torch on the ranks only: the launcher imports this module for check_source, before it needs torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    on_disk = set(check_source(model_dir))
    state = get_model_state_dict(model)
    tied = _tied(model)
    wanted = {k: v for k, v in state.items() if k in on_disk and not (tied and k == "lm_head.weight")}
    missing = sorted(set(state) - set(wanted) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise SourceCheckpointError(f"{model_dir} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]}",
                                    "point model.path at the checkpoint this config belongs to")
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(model_dir)))
    set_model_state_dict(model, wanted)


def _tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def export(model, hf_config, tokenizer, source_dir: Path, out_dir: Path, *, dtype, rank: int, barrier) -> Path | None:
    """Write `out_dir` (see above) from every rank; returns it on rank 0."""
    import torch.distributed.checkpoint as dcp  # torch: as in load_sharded
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if out_dir.is_symlink() or (out_dir.exists() and not is_real_dir(out_dir)):
        raise UnsafeFolder(f"{out_dir} is a symlink or a file; the export is only written into real folders",
                          f"remove {out_dir}, or use a fresh output.dir")
    source = check_source(source_dir)
    state = get_model_state_dict(model)
    if _tied(model):
        state.pop("lm_head.weight", None)   # shared with the embedding; HF re-ties on load
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    staging = out_dir.with_name(f"{atomic.TMP_PREFIX}{out_dir.name}")
    if rank == 0:
        if is_real_dir(staging):
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    barrier()
    names = sorted({p.name for p in source.values()})
    mapping = {k: names.index(source[k].name) + 1 for k in state if k in source}
    from entrypoint.checkpoint.dcp import disk_full, ran_out_of_space, state_bytes  # imports torch

    needed = state_bytes(state) * 2   # the per-rank parts, then the consolidated shards
    try:
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(staging), fqn_to_index_mapping=mapping or None,
                                                                save_distributed=True, enable_consolidation=True))
        barrier()
        if rank != 0:
            return None
        shutil.rmtree(staging / "sharded", ignore_errors=True)
        _name_as_source(staging, names)
        carried = _copy_through(source, set(state) | ({"lm_head.weight"} if _tied(model) else set()), staging)
        _write_index(staging)
        hf_config.use_cache = True                  # training turns it off; generation is 5x slower without it
        hf_config.dtype = str(dtype).removeprefix("torch.")
        hf_config.save_pretrained(str(staging))
        generation = Path(source_dir) / "generation_config.json"
        if generation.is_file():
            shutil.copyfile(generation, staging / "generation_config.json")
        tokenizer.save_pretrained(str(staging))
        (staging / "export_info.json").write_text(json.dumps({"copied_through": carried}, indent=1) + "\n")
        atomic.publish_dir(staging, out_dir, replace=True)
    except BaseException as exc:   # a full disk (or a kill) leaves no half-written export folder
        full = isinstance(exc, Exception) and ran_out_of_space(exc, staging, needed)
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise disk_full(out_dir, needed) from None
        raise
    return out_dir


def _name_as_source(staging: Path, names: list[str]) -> None:
    """The writer names its shards model-0000i-of-0000N.safetensors; give shard i the source's i-th
    file name, so the export replaces the source file for file."""
    for path in staging.glob("*.safetensors"):
        match = re.fullmatch(r"model-(\d{5})-of-\d{5}\.safetensors", path.name)
        if match and int(match.group(1)) <= len(names):
            path.rename(staging / names[int(match.group(1)) - 1])


def _copy_through(source: dict[str, Path], exported: set[str], staging: Path) -> list[str]:
    """Tensors of the source the training model does not hold, unchanged, into their own shard."""
    from safetensors.torch import save_file  # imports torch: as in load_sharded

    names = sorted(set(source) - exported)
    if not names:
        return []
    tensors = {}
    for name in names:
        with safe_open(str(source[name]), "pt") as fh:
            tensors[name] = fh.get_tensor(name)
    save_file(tensors, str(staging / "model-extra.safetensors"), metadata={"format": "pt"})
    return names


def _write_index(staging: Path) -> None:
    """model.safetensors.index.json over every shard in the folder (the writer's and the extra one)."""
    weight_map, total = {}, 0
    for path in sorted(staging.glob("*.safetensors")):
        header = _header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            weight_map[name] = path.name
            total += int(info["data_offsets"][1]) - int(info["data_offsets"][0])
    (staging / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(
        weight_map.items()))}, indent=2) + "\n")
