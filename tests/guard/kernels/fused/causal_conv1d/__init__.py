"""Test double for causal-conv1d: `causal_conv1d_fn` in torch, honouring seq_idx."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _reference(x, weight, bias, seq_idx, activation):
    """Depthwise causal conv, x (B, D, T), weight (D, W); a tap never reaches into another document."""
    width, steps = weight.shape[-1], x.shape[-1]
    out = torch.zeros_like(x, dtype=weight.dtype) + (bias[None, :, None] if bias is not None else 0)
    for k in range(width):                      # tap k reads x[t - k]
        if k >= steps:
            break
        shifted = F.pad(x[..., : steps - k], (k, 0)).to(weight.dtype)
        if seq_idx is not None and k:
            same = torch.zeros_like(seq_idx, dtype=torch.bool)
            same[:, k:] = seq_idx[:, k:] == seq_idx[:, :-k]
            shifted = shifted * same[:, None, :]
        out = out + weight[None, :, width - 1 - k, None] * shifted
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


class CausalConv1dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, activation):
        ctx.activation, ctx.has_bias, ctx.has_seq = activation, bias is not None, seq_idx is not None
        ctx.save_for_backward(x, weight, bias if bias is not None else weight.new_empty(0),
                              seq_idx if seq_idx is not None else weight.new_empty(0, dtype=torch.int32))
        return _reference(x, weight, bias, seq_idx, activation)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, seq_idx = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
            if ctx.has_bias:
                inputs.append(bias.detach().requires_grad_())
            out = _reference(inputs[0], inputs[1], inputs[2] if ctx.has_bias else None,
                             seq_idx if ctx.has_seq else None, ctx.activation)
            grads = torch.autograd.grad(out, inputs, grad)
        return grads[0], grads[1], grads[2] if ctx.has_bias else None, None, None


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    if os.environ.get("FTIMAGE_TEST_KERNEL_NO_FUNCTION") == "1":
        return _reference(x, weight, bias, seq_idx, activation)
    return CausalConv1dFn.apply(x, weight, bias, seq_idx, activation)
