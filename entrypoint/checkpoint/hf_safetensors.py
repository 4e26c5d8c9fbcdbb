"""Hugging Face safetensors in and out, sharded: no rank ever holds the whole model.

Load (torchtitan's way): the model is built on the meta device on every rank, wrapped in
activation checkpointing and FSDP2, then each rank reads only its own shards straight from the
safetensors files through DCP's Hugging Face storage reader. bf16 on disk is upcast into the fp32
sharded master copy as it is read. A checkpoint's names are matched to the parameters as
from_pretrained matches them, with transformers' own conversion mapping (hf_conversions.py): a
renamed tensor is read the same way under its checkpoint name; a parameter transformers makes of
several tensors (per-expert MoE weights stacked into one experts tensor) is made by transformers'
operations from the tensors it needs, a rank reading only its own experts where the parameter is
sharded over them.

Export: the tensors go back to the source's names and layout (the conversions its names went
through at load, reverted as save_pretrained reverts them), then every rank writes its part through
DCP's Hugging Face storage writer, which consolidates the parts into standard shards named as the
source's were, with model.safetensors.index.json. Rank 0 adds what makes the folder a drop-in
replacement for the source: the tensors the training model does not hold, copied through
unchanged (Qwen3.5's `mtp.*` multi-token-prediction weights, used for speculative decoding), the
source's generation_config.json, config.json with use_cache back on, and the tokenizer with its
chat template. The folder is written aside and renamed into place whole.

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
    return {name: path for name, (path, _) in _source_tensors(model_dir).items()}


def _source_tensors(model_dir: Path) -> dict[str, tuple[Path, dict]]:
    """tensor name -> (its file, its checked header entry), for a source check_source accepts."""
    files = weight_files(model_dir)
    headers = {path: _header(path) for path in set(files.values())}
    tensors = {}
    for name, path in files.items():
        if name == "__metadata__":
            continue
        if name not in headers[path]:
            raise SourceCheckpointError(f"{path.name} does not hold {name}, which the index says it does",
                                        "copy the model again; the index and its shards disagree")
        tensors[name] = (path, headers[path][name])
    return tensors


def load_sharded(model, model_dir: Path) -> None:
    """Fill an FSDP2-sharded model (materialized with to_empty) from the source's safetensors, each
    rank reading only its own slices. Names are matched as from_pretrained matches them
    (hf_conversions.py): a tensor transformers renames is read under its checkpoint name, slice by
    slice; a parameter a converter makes of several tensors (per-expert weights stacked into one
    experts tensor) is made from those tensors, and this rank keeps its slice of it."""
    # torch on the ranks only: the launcher imports this module for check_source, before it needs torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from entrypoint.checkpoint.hf_conversions import load_plan

    source = _source_tensors(model_dir)
    state = get_model_state_dict(model)
    tied = _tied(model)
    wanted = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    plan = load_plan(model, list(source), list(state))
    converted = [g for g in plan.converted if any(t in wanted for t in g.targets())]
    missing = sorted(set(wanted) - set(plan.renamed) - {t for g in converted for t in g.targets()})
    if missing:
        raise SourceCheckpointError(f"{model_dir} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]}",
                                    "point model.path at the checkpoint this config belongs to")
    reads = {}
    for target, name in plan.renamed.items():
        if target in wanted:
            path, info = source[name]
            _check_shape(f"{path.name}: {name}" + ("" if name == target else f" (the model's {target})"),
                         info["shape"], wanted[target].shape)
            reads[name] = wanted[target]
    if reads:
        dcp.load(reads, storage_reader=HuggingFaceStorageReader(str(model_dir)))
    loaded = {target: reads[name] for target, name in plan.renamed.items() if target in wanted}
    if converted:
        _load_converted(model, converted, source, wanted)
        loaded.update({k: v for k, v in wanted.items() if k not in loaded})
    # not strict for a tied head alone: it is the embedding, loaded above (every other tensor is in `loaded`)
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=not tied))


def _check_shape(what: str, shape, needed) -> None:
    if list(shape) != list(needed):
        raise SourceCheckpointError(f"{what} has shape {list(shape)}, but the model needs {list(needed)}",
                                    "point model.path at the checkpoint this config belongs to")


def _load_converted(model, groups, source: dict[str, tuple[Path, dict]], wanted: dict) -> None:
    """Each parameter a converter makes: its source tensors read, converted by transformers' own
    operations, and this rank's slice copied in. Where the parameter is sharded over its experts and
    the converter stacks one tensor per expert (Qwen3.5-MoE, Qwen3-Next, Kimi Linear, Nemotron-H), a
    rank reads only the experts it holds, as transformers' shard-on-read does for expert parallelism."""
    from contextlib import ExitStack

    from transformers.distributed.sharding_utils import DtensorShardOperation

    with ExitStack() as files:
        handles = {}

        def opened(name: str):
            path = source[name][0]
            if path not in handles:
                handles[path] = files.enter_context(safe_open(str(path), "pt"))
            return handles[path]

        for group in groups:
            first = group.sources[0][0]
            where = f"{source[first][0].parent}: {group.first}, made of {len(group.sources)} tensor(s) (e.g. {first}),"
            dest = wanted.get(group.first)
            sharded = hasattr(dest, "to_local")
            own_experts = sharded and _per_expert(group, dest, source, where)
            if own_experts:
                if dest.to_local().numel() == 0:
                    continue   # more ranks than experts: this rank holds none
                reader, tensors, index = DtensorShardOperation(dest), {}, {}
                for name, pattern in group.sources:
                    index[pattern] = index.get(pattern, -1) + 1     # the expert, as transformers counts it
                    part = reader.shard_tensor(opened(name).get_slice(name), tensor_idx=index[pattern])
                    if part is not None:                            # None: another rank's expert, not read
                        tensors[name] = part
            else:
                tensors = {name: opened(name).get_tensor(name) for name, _ in group.sources}
            try:
                made = group.run(tensors, model)
            except (RuntimeError, ValueError, IndexError, KeyError) as exc:   # tensors that do not fit together
                raise SourceCheckpointError(f"{where} which do not fit together: {str(exc)[:200]}",
                                            "point model.path at the checkpoint this config belongs to") from None
            del tensors
            for target, value in made.items():
                if target not in wanted:
                    continue
                dest = wanted[target]
                local = dest.to_local() if sharded else dest
                if own_experts:
                    _check_shape(f"{where} this rank's part of it", value.shape, local.shape)
                else:
                    _check_shape(where, value.shape, dest.shape)
                    if sharded:
                        value = DtensorShardOperation(dest).shard_tensor(value)
                local.copy_(value)


def _per_expert(group, dest, source: dict[str, tuple[Path, dict]], where: str) -> bool:
    """Whether a rank may read only its own experts: the converter stacks one source tensor per
    expert on dim 0 first (MergeModulelist), then only concatenates on other dims, and the parameter
    is sharded on dim 0 alone. Each source pattern must then have one tensor per expert, all of one
    shape: checked here, on names and headers, so every rank refuses a checkpoint alike."""
    from torch.distributed.tensor import Replicate, Shard
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = group.converter.operations
    if not (isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            and all(isinstance(op, Concatenate) and op.dim > 0 for op in ops[1:])
            and group.targets() == [group.first] and dest.ndim >= 2
            and all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in dest.placements)):
        return False
    shapes: dict[str, list] = {}
    for name, pattern in group.sources:
        shapes.setdefault(pattern, []).append(list(source[name][1]["shape"]))
    for pattern, found in shapes.items():
        if len(found) != dest.shape[0] or any(shape != found[0] for shape in found):
            raise SourceCheckpointError(
                f"{where} has {len(found)} tensor(s) matching {pattern} of shape(s) "
                f"{sorted({str(shape) for shape in found})}; the model has {dest.shape[0]} experts",
                "point model.path at the checkpoint this config belongs to")
    return True


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
    state, exported = _in_source_layout(model, state, list(source), rank)
    staging = out_dir.with_name(f"{atomic.TMP_PREFIX}{out_dir.name}")
    if rank == 0:
        if is_real_dir(staging):
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    barrier()
    names = sorted({p.name for p in source.values()})
    mapping = {k: names.index(source[k].name) + 1 for k in exported if k in source}
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
        carried = _copy_through(source, exported | ({"lm_head.weight"} if _tied(model) else set()), staging)
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


def _in_source_layout(model, state: dict, source_names: list[str], rank: int) -> tuple[dict, set[str]]:
    """The model's tensors under the names and layout the source checkpoint had (hf_conversions.py:
    the transforms its names went through at load, reverted as save_pretrained reverts them), and
    every name the export writes. A renamed tensor stays this rank's shard. A parameter a converter
    made of several tensors is gathered whole (one at a time, in the same order on every rank) and
    split back by transformers' own operations; each rank keeps every world-th of the pieces, so
    DCP writes each piece once and no rank holds them all."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from entrypoint.checkpoint.hf_conversions import save_plan

    plan = save_plan(model, source_names, list(state))
    out = {new: state[old] for new, old in plan.renamed.items()}
    names = set(out)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    piece = 0
    for group in plan.converted:
        whole = {name: state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
                 for name, _ in group.sources}
        made = group.run(whole, model)
        del whole
        for name in sorted(made):
            names.add(name)
            if piece % world == rank:
                out[name] = made[name].clone()   # its own storage: not a view that keeps the whole alive
            piece += 1
        del made
    return out, names


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
