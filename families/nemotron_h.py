"""Python hooks of the nemotron_h family (its facts live in nemotron_h.yaml).

Every block holds one `mixer`; only a Mamba2 one (NemotronHMamba2Mixer) has an inner unit, the
shared Mamba2 split of families.granitemoehybrid: projections, conv and gated norm in the compute
dtype, A_log / dt_bias / D in fp32. Attention, MoE and MLP blocks have none."""
from __future__ import annotations

import torch

from families.granitemoehybrid import FP32_PARAMS, mamba2_groups, mamba2_mixer, persist_mamba2_state

MIXER = "mixer"
__all__ = ["FP32_PARAMS", "fsdp_groups", "prepare_probe_model"]


def fsdp_groups(layer) -> list[tuple[list, str]]:
    """Inner FSDP units of one block, innermost first: (modules, "compute" | "fp32")."""
    return mamba2_groups(mamba2_mixer(layer, MIXER))


def prepare_probe_model(model):
    """Make the Mamba2 state persist across tokens so a leaked state is visible (small decays)."""
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = mamba2_mixer(layer, MIXER)
            if mixer is not None:
                persist_mamba2_state(mixer)
    return model.eval()
