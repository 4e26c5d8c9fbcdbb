"""Python hooks of the kimi_linear family (its facts live in kimi_linear.yaml)."""
from __future__ import annotations

import torch

# KDA's decay parameters live on its forget gate (KimiLinearForgetGate): A_log feeds exp() and
# dt_bias is added to the gate logits in fp32 before softplus; a bf16 copy of either shifts every
# decay rate, so the gate module keeps them in fp32 in its own FSDP unit.
FP32_PARAMS = ("A_log", "dt_bias")


def _kda(layer):
    inner = getattr(layer, "_checkpoint_wrapped_module", layer)
    mixer = getattr(inner, "self_attn", None)
    gate = getattr(mixer, "forget_gate", None)
    if gate is None or not all(hasattr(gate, name) for name in FP32_PARAMS):
        return None, None
    return mixer, gate


def fsdp_groups(layer) -> list[tuple[list, str]]:
    """Inner FSDP units of one decoder layer, innermost first: (modules, "compute" | "fp32").

    A KDA layer's projections, conv, output norm and the forget gate's two projections form one
    unit in the compute dtype; the forget gate then owns only A_log and dt_bias, as an fp32 unit.
    MLA layers have no inner unit."""
    kda, gate = _kda(layer)
    if kda is None:
        return []
    compute = [m for m in kda.children() if m is not gate and any(True for _ in m.parameters())]
    compute += [m for m in gate.children() if any(True for _ in m.parameters())]
    return [(compute, "compute"), ([gate], "fp32")]


def prepare_probe_model(model):
    """Make the KDA state persist across tokens so a leaked state is visible.

    The FLA-style init draws A in U(1, 16): with dt around softplus(dt_bias) every channel forgets
    within a few tokens, and a leaked state drowns in bf16 noise. Small decays (A in 0.05..0.5)
    carry the previous document's state into the next one, as a trained model does."""
    with torch.no_grad():
        for layer in model.model.layers:
            _, gate = _kda(layer)
            if gate is not None:
                n = gate.A_log.numel()
                a = torch.linspace(0.05, 0.5, n, device=gate.A_log.device).log()
                gate.A_log.copy_(a.view_as(gate.A_log).to(gate.A_log.dtype))
    return model.eval()
