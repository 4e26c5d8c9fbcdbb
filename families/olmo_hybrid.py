"""Python hooks of the olmo_hybrid family (its facts live in olmo_hybrid.yaml).

Its GDN module (`linear_attn`, OlmoHybridGatedDeltaNet) owns A_log and dt_bias directly, as
Qwen3.5's does, so the hooks are qwen3_5_text's: those two in their own fp32 FSDP unit (they
feed exp()/softplus()), small decays for the probe. Attention layers have no inner unit.
"""
from __future__ import annotations

from families.qwen3_5_text import FP32_PARAMS, fsdp_groups, prepare_probe_model

__all__ = ["FP32_PARAMS", "fsdp_groups", "prepare_probe_model"]
