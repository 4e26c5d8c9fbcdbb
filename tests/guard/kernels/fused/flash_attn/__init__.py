"""Test double for flash-attn's varlen attention, as an attention function transformers can run on
CPU: `register()` puts it in transformers' AttentionInterface under "flash_attention_2" (transformers
itself refuses flash_attention_2 without CUDA). Like transformers' flash path, it takes the documents
from cu_seq_lens_q, or from packed position_ids when cu_seq_lens_q is missing."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _bounds(tokens, cu_seq_lens_q, position_ids):
    if cu_seq_lens_q is not None:
        return [int(c) for c in cu_seq_lens_q]
    if position_ids is not None:
        pos = position_ids.reshape(-1)
        starts = [0] + [t for t in range(1, pos.numel()) if int(pos[t]) != int(pos[t - 1]) + 1]
        return starts + [tokens]
    return [0, tokens]


def _reference(q, k, v, bounds, scaling):
    """q (1, H, T, D), k/v (1, Hkv, T, D) -> (1, T, H, D), causal within each document."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    parts = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scaling)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, scaling):
        ctx.bounds, ctx.scaling = bounds, scaling
        ctx.save_for_backward(q, k, v)
        return _reference(q, k, v, bounds, scaling)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            grads = torch.autograd.grad(_reference(*inputs, ctx.bounds, ctx.scaling), inputs, grad)
        return (*grads, None, None)


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            cu_seq_lens_q=None, position_ids=None, **kwargs):
    if query.shape[0] != 1:
        raise ValueError("the flash_attn test double takes one packed row (batch size 1), as flash-attn varlen does")
    bounds = _bounds(query.shape[2], cu_seq_lens_q, position_ids)
    if os.environ.get("FTIMAGE_TEST_KERNEL_NO_FUNCTION") == "1":
        return _reference(query, key, value, bounds, scaling), None
    return FlashAttnVarlenFunc.apply(query, key, value, bounds, scaling), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register("flash_attention_2", flash_attention_forward)
