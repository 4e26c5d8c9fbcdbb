"""Python hooks of the nemotron_h family (its facts live in nemotron_h.yaml).

Every block holds one `mixer`; only a Mamba2 one (NemotronHMamba2Mixer) has an inner unit, the
shared Mamba2 split of families.granitemoehybrid: projections, conv and gated norm in the compute
dtype, A_log / dt_bias / D in fp32. Attention, MoE and MLP blocks have none."""
from __future__ import annotations

from families.granitemoehybrid import FP32_PARAMS, mamba2_fsdp_groups, prepare_mamba2_probe

MIXER = "mixer"
__all__ = ["FP32_PARAMS", "fsdp_groups", "prepare_probe_model"]


def fsdp_groups(layer) -> list[tuple[list, str]]:
    """Inner FSDP units of one block, innermost first: (modules, "compute" | "fp32")."""
    return mamba2_fsdp_groups(layer, MIXER)


def prepare_probe_model(model):
    return prepare_mamba2_probe(model, MIXER)
