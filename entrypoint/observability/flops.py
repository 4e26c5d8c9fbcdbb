"""Throughput, packing and MFU accounting: FLOPs per step, tokens/s, padding, peak memory.
(The metrics JSONL writer is trackers.Metrics.)

FLOPs are counted packing-aware: dense matmuls scale with real tokens, full attention
with sum(L_i^2) over documents (not T^2 over the row, which packing never computes on
a varlen kernel), and GDN layers linearly in tokens. Training = 3x forward (fwd + 2x bwd).
"""
from __future__ import annotations

import json
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch

PEAK_FLOPS_FILE = Path(__file__).with_name("peak_flops.json")


@dataclass(frozen=True, kw_only=True)
class FlopModel:
    dense_per_token: float        # forward matmul FLOPs per token (2 * non-embedding matmul params + head)
    attn_per_sq_token: float      # forward attention FLOPs per (L_i^2), all full-attention layers, causal
    gdn_per_token: float          # forward GDN core FLOPs per token, all linear-attention layers

    def train_flops(self, n_tokens: int, sum_sq_lengths: int) -> float:
        return 3.0 * (self.dense_per_token * n_tokens + self.attn_per_sq_token * sum_sq_lengths
                      + self.gdn_per_token * n_tokens)


def flop_model(model: torch.nn.Module, config) -> FlopModel:
    """Derived from the parameter count and the HF config.

    * dense: 2 FLOPs per multiply-add for every matmul weight a token passes through
      (all 2D weights except the input embedding, which is a lookup).
    * full attention (causal): QK^T and PV are 2 * 2 * L^2 * heads * head_dim, halved by
      the causal mask.
    * GDN chunked delta rule per token and value head: state read/update/output
      ~ 4 * dk * dv, intra-chunk terms ~ 2 * C * (dk + dv) with chunk C = 64; plus the
      depthwise conv (2 * kernel * conv_dim). An approximation, stated as such.
    """
    embed = model.get_input_embeddings().weight
    matmul = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not embed)
    types = list(getattr(config, "layer_types", ["full_attention"] * config.num_hidden_layers))
    n_full = types.count("full_attention")
    n_lin = types.count("linear_attention")
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    attn = n_full * 2.0 * config.num_attention_heads * head_dim  # 4 * L^2 * h * d / 2 (causal)
    gdn = 0.0
    if n_lin:
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        hv = config.linear_num_value_heads
        conv_dim = 2 * dk * config.linear_num_key_heads + dv * hv
        gdn = n_lin * (hv * (4 * dk * dv + 2 * 64 * (dk + dv)) + 2 * config.linear_conv_kernel_dim * conv_dim)
    return FlopModel(dense_per_token=2.0 * matmul, attn_per_sq_token=attn, gdn_per_token=gdn)


def device_peak_flops(configured_tflops: float) -> float | None:
    """Per-device dense bf16 peak in FLOP/s, or None when unknown (e.g. CPU): MFU is then
    reported as null rather than as a made-up number."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    table = json.loads(PEAK_FLOPS_FILE.read_text())["bf16_dense_tflops"]
    for key, tflops in table.items():
        if key.lower() in name.lower():
            return tflops * 1e12
    return None


def peak_memory_bytes() -> dict:
    if torch.cuda.is_available():
        return {"peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    # CPU: the process high-water mark (ru_maxrss is KiB on Linux)
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


@dataclass
class IntervalMeter:
    """Sums over one log interval; `summary` turns them into rates. Token counts here are
    already global (all-reduced over ranks) by the trainer."""

    real_tokens: int = 0
    area: int = 0
    budget_slots: int = 0
    flops: float = 0.0
    data_s: float = 0.0
    compute_s: float = 0.0
    steps: int = 0
    losses: list = field(default_factory=list)

    def add(self, stats, flops: float, budget: int) -> None:
        """One step's StepStats (trainer.py); token counts there are already global."""
        self.steps += 1
        self.real_tokens += stats.n_real
        self.area += stats.area
        self.budget_slots += stats.n_micro * budget
        self.flops += flops
        self.data_s += stats.data_s
        self.compute_s += stats.compute_s
        self.losses.append(stats.loss)

    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def summary(self, wall_s: float, world_size: int, peak: float | None) -> dict:
        out = {
            "tokens_per_s": self.real_tokens / wall_s if wall_s > 0 else 0.0,
            "tokens_per_s_per_device": self.real_tokens / wall_s / world_size if wall_s > 0 else 0.0,
            "padding_ratio": 1.0 - self.real_tokens / self.area if self.area else 0.0,
            "packing_efficiency": self.real_tokens / self.budget_slots if self.budget_slots else 0.0,
            "step_time_s": wall_s / max(self.steps, 1),
            "data_time_s": self.data_s / max(self.steps, 1),
            "compute_time_s": self.compute_s / max(self.steps, 1),
            "tflops_per_device": self.flops / wall_s / world_size / 1e12 if wall_s > 0 else 0.0,
            "mfu": (self.flops / wall_s / world_size / peak) if (peak and wall_s > 0) else None,
        }
        out.update(peak_memory_bytes())
        return out
