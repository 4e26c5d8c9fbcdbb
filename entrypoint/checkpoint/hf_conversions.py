"""Which tensors of a Hugging Face checkpoint make which parameters of the model, and back: transformers'
own conversion mapping, run on names.

transformers 5 keeps a checkpoint under its original names and converts it as it loads
(conversion_mapping.get_model_conversion_mapping): renamings (Granite 4.0-H's
`block_sparse_moe.router.layer.weight` -> `block_sparse_moe.router.weight`, Nemotron-H's `backbone.`
-> `model.`) and converters that make one parameter of several tensors (Qwen3.5-MoE's and
Qwen3-Next's per-expert `experts.N.gate_proj/up_proj/down_proj` stacked into `experts.gate_up_proj`
and `experts.down_proj`, Kimi Linear's and Olmo-Hybrid's q/k/v conv1d concatenated). save_pretrained
reverts the transforms the checkpoint used (core_model_loading.revert_weight_conversion).

Here the same transforms, matched the same way (core_model_loading.rename_source_key, keys in
transformers' order), plan a load without reading a tensor: a renamed tensor is read under its
source name, slice by slice like any other; a converted parameter names the source tensors its
converter takes. The export plans the reverse from the transforms the source checkpoint's names
used, so it writes the layout the source had, as from_pretrained then save_pretrained would.
"""
from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field


@dataclass
class Converted:
    """Tensors one converter of transformers makes from several (or several from one)."""
    converter: object              # a fresh WeightConverter: its patterns and operations
    first: str                     # the name transformers keys the group by (its first target)
    sources: list[tuple[str, str]] = field(default_factory=list)   # (name, the converter's pattern it matched)

    def targets(self) -> list[str]:
        """The names it makes, as the load side knows them before converting (no wildcard)."""
        first_pattern = self.converter.target_patterns[0]
        return [self.first.replace(first_pattern, t, 1) for t in self.converter.target_patterns]

    def run(self, tensors: dict, model) -> dict:
        """{made name: tensor} from {source name: tensor}, by the converter's own operations."""
        converter = deepcopy(self.converter)
        for name, pattern in self.sources:
            if name in tensors:
                converter.add_tensor(self.first, name, pattern, tensors[name])
        made = converter.convert(self.first, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}


@dataclass
class Plan:
    renamed: dict[str, str]        # made name -> source name: the same tensor, maybe under another name
    converted: list[Converted]
    unmatched: list[str]           # source names that make nothing
    used: list                     # the transforms the source names went through (for the way back)


def _split(transforms):
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _plan(names, wanted, renamings, converters, *, reverse: bool, base_model_prefix=None) -> Plan:
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
    meta = dict.fromkeys(wanted, True) if wanted is not None else None
    renamed, groups, unmatched = {}, {}, []
    for name in sorted(names, key=dot_natural_key):   # transformers' order: experts 0, 1, ..., 10
        target, pattern = rename_source_key(name, renamings, converters, base_model_prefix, meta, reverse=reverse)
        if meta is not None and target not in meta and name in meta:
            target, pattern = rename_source_key(name, [], [], base_model_prefix, meta)
        if meta is not None and target not in meta:
            unmatched.append(name)
        elif pattern is not None:
            if target not in groups:
                groups[target] = Converted(deepcopy(pattern_to_converter[pattern]), target)
            groups[target].sources.append((name, pattern))
        else:
            renamed.setdefault(target, name)   # two names for one tensor: the first, as transformers
    return Plan(renamed, list(groups.values()), unmatched, [])


def transforms_of(model) -> list:
    """The transforms from_pretrained applies to this model (get_model_conversion_mapping). fully_shard
    gives each module it wraps a class of its own (FSDPQwen3_5MoeForCausalLM, defined in torch), which
    transformers takes for custom code and skips; so a wrapped model's transforms are those of a
    fresh model of its own class and config, on the meta device."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from transformers.conversion_mapping import get_model_conversion_mapping

    if any(isinstance(module, FSDPModule) for module in model.modules()):
        cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
        with torch.device("meta"):
            model = cls(deepcopy(model.config))
    return get_model_conversion_mapping(model)


def load_plan(model, source_names, wanted) -> Plan:
    """How the checkpoint's tensors `source_names` fill the model's tensors `wanted`, as
    from_pretrained would match them."""
    transforms = transforms_of(model)
    renamings, converters = _split(transforms)
    plan = _plan(source_names, wanted, renamings, converters, reverse=False, base_model_prefix=model.base_model_prefix)
    plan.used = [t for t in transforms if t.was_used()]
    return plan


def save_plan(model, source_names, names) -> Plan:
    """The model's tensors `names` under the checkpoint layout the source (`source_names`) had:
    the reverse of the transforms its names used, as save_pretrained reverts them."""
    used = load_plan(model, source_names, names).used
    renamings, converters = _split([t.reverse_transform() for t in used[::-1]])
    return _plan(names, None, renamings, converters, reverse=True)
