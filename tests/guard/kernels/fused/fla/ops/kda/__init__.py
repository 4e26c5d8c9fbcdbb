"""Test double for fla's `chunk_kda` (Kimi delta attention), where transformers 5.18 imports it:
`fla.ops.kda.chunk_kda` (hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS maps chunk_kda to "ops.kda";
fla's package root does not export it, so transformers imports fla.ops.kda itself).

It is transformers' own torch reference (modeling_kimi_linear.chunk_kimi_delta_attention, unwrapped)
run one document at a time, so `cu_seqlens` is honoured, behind an autograd.Function. The
signature is fla 0.6.0's: transformers keeps only the kwargs it names (applicable_params), so a
Kimi layer's `cu_seq_lens_q` never reaches it; `cu_seqlens` does. Options the reference cannot
compute are refused, not ignored: a double that silently skipped them would pass tests the real
kernel might fail."""
from __future__ import annotations

import inspect
import math
import os

import torch

# fla 0.6.0 options with no counterpart in transformers' reference, and their defaults
_UNSUPPORTED = {"use_gate_in_kernel": False, "use_beta_sigmoid_in_kernel": False, "allow_neg_eigval": False,
                "safe_gate": False, "lower_bound": None, "return_intermediate_states": False,
                "state_v_first": False, "cp_context": None, "use_graph": False}


def _torch_reference():
    # imported at call time: transformers imports this package while it executes the modeling module
    from transformers.models.kimi_linear import modeling_kimi_linear

    return inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)


def _bounds(q, cu_seqlens) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, q.shape[1])]
    if q.shape[0] != 1:     # fla's own rule for varlen input
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    cuts = [int(c) for c in cu_seqlens]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _state_of(initial_state, index: int, cu_seqlens):
    """fla's initial_state is [N, H, K, V]: one per document with cu_seqlens, else one per row."""
    if initial_state is None:
        return None
    return initial_state[index:index + 1] if cu_seqlens is not None else initial_state


def _run(q, k, v, g, beta, initial_state, cu_seqlens, l2norm, final: bool):
    """(output, final states [N, H, K, V] or None), one reference call per document."""
    reference = _torch_reference()
    outs, states = [], []
    for i, (a, b) in enumerate(_bounds(q, cu_seqlens)):
        out, state = reference(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                               initial_state=_state_of(initial_state, i, cu_seqlens),
                               output_final_state=final, use_qk_l2norm_in_kernel=l2norm)
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=1), (torch.cat(states, dim=0) if final else None)


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, l2norm):
        ctx.l2norm, ctx.cu_seqlens = l2norm, cu_seqlens
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        return _run(q, k, v, g, beta, initial_state, cu_seqlens, l2norm, final=False)[0]

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() if t is not None else None for t in ctx.saved_tensors]
            out = _run(*inputs, ctx.cu_seqlens, ctx.l2norm, final=False)[0]
            present = [t for t in inputs if t is not None]
            grads = iter(torch.autograd.grad(out, present, grad, allow_unused=True))
        return (*(next(grads) if t is not None else None for t in inputs), None, None)


def _refuse_unsupported(scale, head_dim: int, options: dict) -> None:
    changed = sorted(name for name, default in _UNSUPPORTED.items() if options[name] != default)
    if scale is not None and not math.isclose(scale, head_dim ** -0.5):
        changed.append("scale")         # the reference always scales by 1/sqrt(K)
    if changed:
        raise NotImplementedError(f"the chunk_kda test double cannot compute {', '.join(changed)} "
                                  "(transformers' torch reference has no such option)")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    _refuse_unsupported(scale, q.shape[-1], {
        "use_gate_in_kernel": use_gate_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
        "allow_neg_eigval": allow_neg_eigval, "safe_gate": safe_gate, "lower_bound": lower_bound,
        "return_intermediate_states": return_intermediate_states, "state_v_first": state_v_first,
        "cp_context": cp_context, "use_graph": use_graph})
    cu_seqlens = cu_seqlens if cu_seqlens is not None else cu_seqlens_cpu
    state = None
    if output_final_state:     # what a cache keeps; computed without gradient, as the GDN double does
        with torch.no_grad():
            state = _run(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, final=True)[1]
    if os.environ.get("FTIMAGE_TEST_KERNEL_NO_FUNCTION") == "1":
        return _run(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, final=False)[0], state
    return ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel), state
