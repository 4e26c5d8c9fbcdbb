"""Python hooks of the lfm2 family (its facts live in lfm2.yaml)."""
from __future__ import annotations


def fsdp_groups(layer) -> list[tuple[list, str]]:
    """No inner FSDP units: a short-conv layer has no recurrent state and no decay parameters
    (only its projections and the depthwise conv weight), so nothing must stay in fp32."""
    return []


def prepare_probe_model(model):
    """Nothing to persist: the short conv has no recurrent state. Its width-3 window (conv_L_cache)
    already reaches the previous document's last 2 tokens when seq_idx is lost, and the random
    init makes that leak plain, so the model is only put in eval mode."""
    return model.eval()
