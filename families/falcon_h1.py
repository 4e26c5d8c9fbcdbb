"""Python hooks of the falcon_h1 family (its facts live in falcon_h1.yaml).

Every layer holds a Mamba2 mixer at `mamba` (FalconH1Mixer) beside its attention; the mixer's
inner unit is the shared Mamba2 split of families.granitemoehybrid: projections and conv (and the
gated norm when mamba_rms_norm) in the compute dtype, A_log / dt_bias / D in fp32. Its muP
`mup_vector` is a buffer, not a parameter, so it is in neither unit."""
from __future__ import annotations

from families.granitemoehybrid import FP32_PARAMS, mamba2_fsdp_groups, mamba2_mixer, prepare_mamba2_probe

MIXER = "mamba"
__all__ = ["FP32_PARAMS", "fsdp_groups", "prepare_probe_model", "rebuild_buffers"]


def fsdp_groups(layer) -> list[tuple[list, str]]:
    """Inner FSDP units of one block, innermost first: (modules, "compute" | "fp32")."""
    return mamba2_fsdp_groups(layer, MIXER)


def prepare_probe_model(model):
    return prepare_mamba2_probe(model, MIXER)


def rebuild_buffers(model, device) -> None:
    """The muP `mup_vector` of every mixer is a non-persistent buffer computed from the config at
    __init__: a model built on the meta device and materialised with to_empty holds garbage there
    (NaN gradients at the first step), and no checkpoint carries it, so it is computed again."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    inner = getattr(model, "model", model)
    vector = compute_mup_vector(inner.config).to(device)
    for layer in inner.layers:
        mixer = mamba2_mixer(layer, MIXER)
        if mixer is not None:
            mixer.mup_vector.data.copy_(vector.to(mixer.mup_vector.dtype))
