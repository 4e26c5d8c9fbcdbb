"""Python hooks of the qwen3_next family (its facts live in qwen3_next.yaml).

Its GDN layers keep A_log and dt_bias on the `linear_attn` module as Qwen3.5's do, so the hooks
are qwen3_5_text's: the GDN decay parameters in their own fp32 FSDP unit, small decays for the probe.
"""
from __future__ import annotations

from families.qwen3_5_text import FP32_PARAMS, fsdp_groups, prepare_probe_model

__all__ = ["FP32_PARAMS", "fsdp_groups", "prepare_probe_model"]
