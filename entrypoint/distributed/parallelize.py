"""Apply activation checkpointing and FSDP2 to a causal LM of a known family, in this order:

1. Activation checkpointing wraps each chosen decoder layer FIRST, so the checkpointed
   region sits inside that layer's FSDP unit: FSDP's pre-backward unshard then covers the
   recompute, and the recompute never triggers a second all-gather.
2. fully_shard bottom-up (inner units first; a parent unit only takes parameters no
   child unit owns):
   a. the family's inner units (families/<name>.py: fsdp_groups); for Qwen3.5, per GDN
      layer its projections/conv/norm as one bf16 group, then the GDN module itself as an
      fp32 unit, which by then owns only A_log and dt_bias (a bf16 copy of A_log shifts
      every decay rate);
   b. each decoder layer (attention or MLP leftovers);
   c. embeddings and the head as their own units (their all-gather is the largest for
      big vocabularies) unless tied, in which case one shared parameter must stay in
      one unit: the root's;
   d. the root, which owns the final norm and anything left.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from families import DEFAULT_FAMILY, load_family
from families import runtime as family_runtime

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def decoder_layers(model: nn.Module, family_name: str = DEFAULT_FAMILY) -> nn.ModuleList:
    return family_runtime.decoder_layers(load_family(family_name), model)


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int, family_name: str = DEFAULT_FAMILY) -> int:
    """Wrap decoder layers (all for `full`, one in `every` for `selective`). Returns the count."""
    if mode == "none":
        return 0
    layers = decoder_layers(model, family_name)
    wrapped = 0
    for i, layer in enumerate(layers):
        if mode == "full" or i % every == 0:
            # non-reentrant: works with FSDP2 hooks and with kwargs (cu_seq_lens, seq_idx)
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            wrapped += 1
    return wrapped


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: str, reduce_dtype: str,
               reshard_after_forward: bool = True, family_name: str = DEFAULT_FAMILY) -> None:
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    family = load_family(family_name)
    hooks = family_runtime.hooks(family)
    for layer in decoder_layers(model, family_name):
        for modules, policy in hooks.fsdp_groups(layer):
            fully_shard(modules if len(modules) > 1 else modules[0], mp_policy=fp32 if policy == "fp32" else mp,
                        **kw)
        fully_shard(layer, mp_policy=mp, **kw)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if not tied:
        fully_shard(model.get_input_embeddings(), mp_policy=mp, **kw)
        # The head's output is the last forward; keeping it gathered saves one all-gather
        # at the start of backward.
        fully_shard(model.get_output_embeddings(), mp_policy=mp, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp, **kw)


def build_mesh(device_type: str, world: int, dp_replicate: int = 1):
    """Flat FSDP over every rank, or HSDP: `dp_replicate` replicas (across nodes, say), each sharding
    the model over world / dp_replicate ranks (within a node). The launcher has refused a
    dp_replicate that does not divide the world size."""
    if dp_replicate <= 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, world // dp_replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
