"""Model families: the one home of everything the project knows about a model family.

    families/<name>.yaml   the facts, as data: modeling classes, layer kinds and the fused
                           functions each needs (with the kwarg that carries document
                           boundaries), what its attention uses (head dims, dtypes,
                           features), and its flavours (tiny test model, verify's probe,
                           the GPU benchmark model)
    families/<name>.py     its Python hooks (FSDP units, probe preparation)
    families/runtime.py    builds models from flavours (torch + transformers)
    families/binding.py    what transformers bound for the fused functions (read from its
                           wrapper's closure) and why a kernel package fell back; verify's
                           dispatch check and the runtime guard both read it

This module reads the data only (no torch), so `python -m build --plan` stays fast.
Which kernel backs a function is not a family fact: the kernels manifest's `replaces:`
says that, and the build lock records it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from contracts import safe_yaml
from contracts.errors import FixableError
from contracts.schema import InvalidInput, Problems, Reader, rule
from families import source_check

FAMILIES_DIR = Path(__file__).resolve().parent
DEFAULT_FAMILY = "qwen3_5_text"
NAME = r"[a-z][a-z0-9_]{0,63}"
DTYPES = ("bf16", "fp16")
FEATURES = ("dropout", "alibi", "softcap", "sliding_window")
# What the isolation probe measures in a layer kind: full attention, the gated delta rule (GDN),
# Kimi delta attention (KDA), the depthwise causal conv and the Mamba2 SSD chunk scan.
MEASURES = ("attention", "gdn", "kda", "conv", "ssd")
# How transformers runs MoE experts (integrations/moe.py ALL_EXPERTS_FUNCTIONS, plus its
# per-expert `eager` loop); training needs the grouped path.
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


class UnknownFamily(FixableError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(f"model family {name!r} is not known (known: {', '.join(known) or 'none'})",
                         f"build the image for one of: {', '.join(known)}, or add families/{name}.yaml")


class FamilyError(InvalidInput):
    title = "a model family file"


@dataclass(frozen=True, kw_only=True)
class FusedFunction:
    function: str = field(metadata=rule(pattern=NAME))        # the name kernels declare in `replaces:`
    wrapper: str = field(metadata=rule(pattern=r"[A-Za-z_][A-Za-z0-9_]*"))  # wrapped modeling-module attribute
    # carries document boundaries to the kernel: causal-conv1d and mamba-ssm take seq_idx (each
    # token's document), fla takes cu_seqlens (document starts)
    boundary_kwarg: Literal["seq_idx", "cu_seqlens"]


# The one step of a layer kind with no fused functions (full attention): the attention function
# the layer gets from transformers' ALL_ATTENTION_FUNCTIONS.get_interface must run.
ATTENTION_PATH = "attention"


def _path_not_empty(path: tuple[str, ...]):
    if not path:
        return ("an empty path", "list the fused functions (their `fused[].function` names) that together make "
                "one complete fused path of this layer kind, e.g. [causal_conv1d_fn, mamba_chunk_scan_combined], "
                "or remove the empty entry")
    return None


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    module: str = field(metadata=rule(pattern=r"[A-Za-z_][A-Za-z0-9_]*"))  # token mixer attribute on a layer
    # the token mixer's class in the modeling module: the runtime guard wraps its forward, so it sees
    # the layer kind run even when the functions it should call are never called
    layer_class: str = field(metadata=rule(
        pattern=r"[A-Za-z_][A-Za-z0-9_]*",
        fix="name the token mixer's class in the modeling module, e.g. `layer_class: Qwen3_5GatedDeltaNet`"))
    measure: tuple[Literal["attention", "gdn", "kda", "conv", "ssd"], ...] = ()
    fused: tuple[FusedFunction, ...] = ()
    # alternative complete fused paths, each a list of `fused[].function` names that must all run in
    # one layer call (a layer that picks one kernel or another, e.g. Mamba2's split-conv1d-scan or
    # conv1d + chunk scan). Absent: one path of all the kind's fused functions (complete_paths)
    paths: tuple[tuple[str, ...], ...] = field(default=(), metadata=rule(each=_path_not_empty))

    def complete_paths(self) -> tuple[tuple[str, ...], ...]:
        """What one call of this layer kind must run: any one of these, every function of it."""
        if self.paths:
            return self.paths
        if self.fused:
            return (tuple(f.function for f in self.fused),)
        return ((ATTENTION_PATH,),)


@dataclass(frozen=True, kw_only=True)
class AttentionFeatures:
    dropout: bool = False
    alibi: bool = False
    softcap: bool = False
    sliding_window: bool = False

    def used(self) -> tuple[str, ...]:
        return tuple(f for f in FEATURES if getattr(self, f))


def _head_dims(values: tuple[int, ...]):
    bad = [v for v in values if not 8 <= v <= 1024]
    if not values or bad:
        return f"head dims must be 8..1024, got {list(values)}", "list the attention head dims, e.g. [256]"
    return None


@dataclass(frozen=True, kw_only=True)
class Attention:
    implementation: Literal["flash_attention_2", "sdpa", "eager"]
    head_dims: tuple[int, ...] = field(metadata=rule(check=_head_dims))
    causal: bool = True
    varlen: bool = True
    features: AttentionFeatures = field(default_factory=AttentionFeatures)
    config_keys: dict[str, str] = field(default_factory=dict)

    @property
    def replaces(self) -> str:
        """How a kernel declares that it provides this attention (`replaces:` in the manifest)."""
        return f"attention:{self.implementation}"


@dataclass(frozen=True, kw_only=True)
class Experts:
    """A MoE family's experts: transformers picks their implementation at load time
    (`get_correct_experts_implementation`) and may take a per-expert fallback at run time."""

    # the experts class, decorated with transformers' @use_experts_implementation
    layer_class: str = field(metadata=rule(pattern=r"[A-Za-z_][A-Za-z0-9_]*"))
    # what training needs: the grouped GEMM path (one op per step, not one per expert)
    implementation: Literal["grouped_mm", "batched_mm"] = "grouped_mm"


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str = field(metadata=rule(pattern=NAME))
    # the config.json `model_type`s that name this family (a multimodal checkpoint's own type and
    # its `text_config` type both count); verify maps a mounted model to its family by these
    model_types: tuple[str, ...] = field(metadata=rule(each=lambda v: None if re.fullmatch(NAME, v) else (
        f"{v!r} is not a model_type", "list transformers model_type names, e.g. [qwen3_5_moe, qwen3_5_moe_text]")))
    modeling_module: str = field(metadata=rule(pattern=r"transformers(\.[A-Za-z_][A-Za-z0-9_]*)+"))
    config_class: str = field(metadata=rule(pattern=r"[A-Za-z_][A-Za-z0-9_]*"))
    causal_lm_class: str = field(metadata=rule(pattern=r"[A-Za-z_][A-Za-z0-9_]*"))
    decoder_layers: str = field(metadata=rule(pattern=r"[A-Za-z_][A-Za-z0-9_.]*"))
    hooks: str = field(metadata=rule(pattern=r"families\.[a-z0-9_]+"))
    dtypes: tuple[Literal["bf16", "fp16"], ...] = field(metadata=rule(
        check=lambda v: None if v else ("no dtypes listed", "list what the family trains in, e.g. [bf16]")))
    # the config attribute naming each decoder layer's kind (its values are the keys of
    # layer_kinds); null: every decoder layer holds every kind side by side (Falcon-H1)
    layer_types_key: str | None = field(default="layer_types", metadata=rule(pattern=r"[a-z_][a-z0-9_]*"))
    layer_kinds: dict[str, LayerKind]
    # values of the layer-types attribute whose layers hold no token mixer (Nemotron-H's `moe` and
    # `mlp` blocks: an MoE or MLP where other layers hold Mamba2 or attention). They have nothing to
    # fuse and no boundary to honour, and a LayerKind without fused functions means "attention
    # path", so they stay out of layer_kinds; code walking layers by kind skips these.
    mixerless_layer_types: tuple[str, ...] = field(default=(), metadata=rule(
        each=lambda v: None if re.fullmatch(NAME, v) else (f"{v!r} is not a layer type name",
                                                           "list layer-type values, e.g. [moe, mlp]")))
    attention: Attention
    experts: Experts | None = None
    # model kwargs our trainer adds to a packed batch because the pinned modeling code never
    # derives them: kwarg -> the collated key (contracts.collate) whose tensor it carries
    batch_adds: dict[str, str] = field(default_factory=dict)
    flavours: dict[str, dict[str, Any]]

    @property
    def fused_functions(self) -> tuple[FusedFunction, ...]:
        return tuple(f for kind in self.layer_kinds.values() for f in kind.fused)

    def needs(self) -> tuple[str, ...]:
        """Everything the family needs backed by a fused kernel, in the manifest's vocabulary."""
        return tuple(f.function for f in self.fused_functions) + (self.attention.replaces,)

    def flavour(self, name: str, *, head_dim: int | None = None) -> dict[str, Any]:
        """A flavour's config values, with `base:` and `attention.head_dims[0]` resolved.
        `head_dim` overrides the attention head dim (verify passes what the lock compiled)."""
        if name not in self.flavours:
            raise KeyError(f"family {self.name} has no flavour {name!r} (has: {', '.join(self.flavours)})")
        raw = dict(self.flavours[name])
        base = raw.pop("base", None)
        values = {**(self.flavour(base) if base else {}), **raw}
        for key, value in list(values.items()):
            if value == "attention.head_dims[0]":
                values[key] = self.attention.head_dims[0]
        if head_dim is not None and "head_dim" in values:
            values["head_dim"] = head_dim
        return values


@cache
def known_families() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in FAMILIES_DIR.glob("*.yaml") if re.fullmatch(NAME, p.stem)))


def with_batch_adds(family: Family, batch: dict) -> dict:
    """A collated batch with the family's `batch_adds` (kwarg -> the collated key it copies); an
    unpacked batch holds no source key and comes back unchanged."""
    extra = {k: batch[src] for k, src in family.batch_adds.items() if src in batch and k not in batch}
    return {**batch, **extra} if extra else batch


def family_for_model_type(model_type: str, names) -> str | None:
    """Which of the families `names` covers a config.json `model_type` (None: none does)."""
    for name in names:
        if model_type in load_family(name).model_types:
            return name
    return None


def model_types_of(config) -> tuple[str, ...]:
    """The model_types a config names (a transformers config or a config.json dict): its own, then
    its text_config's (a multimodal checkpoint nests the text model there)."""
    def get(obj, key):
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    found = []
    for candidate in (config, get(config, "text_config")):
        model_type = get(candidate, "model_type") if candidate is not None else None
        if isinstance(model_type, str) and model_type:
            found.append(model_type)
    return tuple(found)


def family_of_config(config, names) -> str | None:
    """Which of the families `names` covers a model config (None: none of them does)."""
    for model_type in model_types_of(config):
        found = family_for_model_type(model_type, names)
        if found:
            return found
    return None


@cache
def load_family(name: str) -> Family:
    """The family's facts; UnknownFamily if there is no such family, FamilyError if its file is bad."""
    if not re.fullmatch(NAME, name or "") or name not in known_families():
        raise UnknownFamily(name, list(known_families()))
    path = FAMILIES_DIR / f"{name}.yaml"
    problems = Problems()
    try:
        data = safe_yaml.load_file(path)
    except safe_yaml.YamlRefused as exc:
        problems.add(str(path), "(file)", exc.problem, exc.fix, exc.code)
        data = None
    family = read_family(name, data, problems) if data is not None else None
    problems.raise_if_any(FamilyError)
    return family


def read_family(name: str, data: Any, problems: Problems) -> Family | None:
    """The family in `data` (a parsed families/<name>.yaml), its problems recorded in `problems`."""
    file = f"families/{name}.yaml"
    family = Reader(file, problems).read(Family, data)
    if family is not None and family.name != name:
        problems.add(file, "name", f"the file says {family.name!r}", f"set name: {name}")
    if family is not None:
        _check_paths(family, problems, file)
        for where, problem, fix in source_check.problems(family):
            problems.add(file, where, problem, fix, "transformers-source")
    return family


def _check_paths(family: Family, problems: Problems, file: str) -> None:
    """Each name in a layer kind's `paths:` is one of that kind's `fused[].function` names."""
    for kind_name, kind in family.layer_kinds.items():
        names = [f.function for f in kind.fused]
        for i, path in enumerate(kind.paths):
            for j, function in enumerate(path):
                if function in names:
                    continue
                where = f"layer_kinds.{kind_name}.paths[{i}][{j}]"
                if not names:
                    problems.add(file, where, f"{function!r}: layer kind {kind_name} has no fused functions",
                                 f"remove `paths:` from layer_kinds.{kind_name} (its path is the attention function "
                                 "transformers hands out), or list its functions under `fused:`")
                else:
                    problems.add(file, where, f"{function!r} is not a fused function of layer kind {kind_name}",
                                 f"use one of its `fused[].function` names ({', '.join(names)}), or add {function} "
                                 f"to layer_kinds.{kind_name}.fused")
