"""Python hooks of the granitemoehybrid family (its facts live in granitemoehybrid.yaml), and the
Mamba2 mixer hooks nemotron_h and falcon_h1 share."""
from __future__ import annotations

import torch

# A Mamba2 mixer's SSM parameters: A_log feeds exp(), dt_bias is added to dt before softplus and
# D scales the skip path; mamba-ssm's kernels read them in fp32, and a bf16 copy of A_log shifts
# every decay rate, so they stay in fp32 in their own FSDP unit.
FP32_PARAMS = ("A_log", "dt_bias", "D")
MIXER = "mamba"          # GraniteMoeHybridDecoderLayer's Mamba2 attribute (None on attention layers)


def mamba2_mixer(layer, attribute: str):
    """The Mamba2 mixer at `attribute` of a (possibly checkpoint-wrapped) decoder layer, or None."""
    inner = getattr(layer, "_checkpoint_wrapped_module", layer)
    mixer = getattr(inner, attribute, None)
    if mixer is None or not all(isinstance(getattr(mixer, name, None), torch.nn.Parameter) for name in FP32_PARAMS):
        return None
    return mixer


def mamba2_groups(mixer) -> list[tuple[list, str]]:
    """in_proj, conv1d, the gated norm and out_proj as one compute-dtype unit; the mixer itself
    then owns only A_log, dt_bias and D, as an fp32 unit."""
    if mixer is None:
        return []
    children = [m for m in mixer.children() if any(True for _ in m.parameters())]
    return [(children, "compute"), ([mixer], "fp32")]


def persist_mamba2_state(mixer) -> None:
    """Make a leaked Mamba2 state visible in the mixer's output.

    Small decays (A in 0.05..0.5): the init's A = 1..n_heads (times dt near softplus(1)) forgets
    within a token or two; these carry the previous document's state into the next one, as a
    trained model does. And no skip path (D = 0): at random init B, C and x are ~1e-3 each, so
    C.state is ~1e4 times smaller than D*x and a leak through the state measured ~1e-4 relative,
    within noise; D*x carries nothing across tokens, so without it the output is the state path."""
    n = mixer.A_log.numel()
    a = torch.linspace(0.05, 0.5, n, device=mixer.A_log.device).log()
    mixer.A_log.copy_(a.to(mixer.A_log.dtype))
    mixer.D.zero_()


def mamba2_fsdp_groups(layer, attribute: str) -> list[tuple[list, str]]:
    """Inner FSDP units of one decoder layer whose Mamba2 mixer sits at `attribute`."""
    return mamba2_groups(mamba2_mixer(layer, attribute))


def prepare_mamba2_probe(model, attribute: str):
    """Make each Mamba2 mixer's state persist across tokens so a leaked state is visible."""
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = mamba2_mixer(layer, attribute)
            if mixer is not None:
                persist_mamba2_state(mixer)
    return model.eval()


def fsdp_groups(layer) -> list[tuple[list, str]]:
    """Inner FSDP units of one decoder layer, innermost first: (modules, "compute" | "fp32").
    Attention layers have none (the MoE and shared MLP stay in the layer's own unit)."""
    return mamba2_fsdp_groups(layer, MIXER)


def prepare_probe_model(model):
    return prepare_mamba2_probe(model, MIXER)
