"""Python hooks of the qwen3_5_text family (its facts live in qwen3_5_text.yaml)."""
from __future__ import annotations

import torch

# The GDN decay parameters feed exp()/softplus(); a bf16 copy of A_log shifts every decay
# rate, so they stay in fp32 in their own FSDP unit.
FP32_PARAMS = ("A_log", "dt_bias")


def fsdp_groups(layer) -> list[tuple[list, str]]:
    """Inner FSDP units of one decoder layer, innermost first: (modules, "compute" | "fp32").

    A GDN layer's projections, conv and norm form one unit in the compute dtype; the GDN
    module itself then owns only A_log and dt_bias, as an fp32 unit."""
    inner = getattr(layer, "_checkpoint_wrapped_module", layer)
    gdn = getattr(inner, "linear_attn", None)
    if gdn is None or not all(hasattr(gdn, name) for name in FP32_PARAMS):
        return []
    children = [m for m in gdn.children() if any(True for _ in m.parameters())]
    return [(children, "compute"), ([gdn], "fp32")]


def prepare_probe_model(model):
    """Make the GDN state persist across tokens so a leaked state is visible.

    Random init gives A in U(0.01, 16), so most heads forget their state within a token or two,
    and a delta-rule leak measured ~0.05 relative: too close to bf16 noise. Small decays (A in
    0.05..0.5) carry the previous document's state into the next one, as a trained model does.
    """
    with torch.no_grad():
        for layer in model.model.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None:
                n = gdn.A_log.numel()
                gdn.A_log.copy_(torch.linspace(0.05, 0.5, n, device=gdn.A_log.device).log().to(gdn.A_log.dtype))
    return model.eval()
