"""Test double for fla's `chunk_gated_delta_rule`: transformers' own torch reference, run one
document at a time (so cu_seqlens is honoured), behind an autograd.Function."""
from __future__ import annotations

import inspect
import os

import torch


def _torch_reference():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def _reference(q, k, v, g, beta, cu_seqlens, l2norm):
    bounds = [0, q.shape[1]] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    reference = _torch_reference()
    parts = [reference(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=None,
                       output_final_state=False, use_qk_l2norm_in_kernel=l2norm)[0]
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts, dim=1)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, l2norm):
        ctx.l2norm, ctx.cu_seqlens = l2norm, cu_seqlens
        ctx.save_for_backward(q, k, v, g, beta)
        return _reference(q, k, v, g, beta, cu_seqlens, l2norm)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            out = _reference(*inputs, ctx.cu_seqlens, ctx.l2norm)
            grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
        return (*grads, None, None)


def _final_state(q, k, v, g, beta, cu_seqlens, l2norm):
    """The recurrent state after the last document (what a cache keeps), without gradient."""
    start = 0 if cu_seqlens is None else int(cu_seqlens[-2])
    with torch.no_grad():
        return _torch_reference()(q[:, start:], k[:, start:], v[:, start:], g[:, start:], beta[:, start:],
                                  initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)[1]


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    state = _final_state(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel) if output_final_state else None
    if os.environ.get("FTIMAGE_TEST_KERNEL_NO_FUNCTION") == "1":
        return _reference(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel), state
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel), state
