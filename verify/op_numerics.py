"""Each fused op, forward AND backward, against its torch reference run per document in fp32.

The inputs are packed documents, because the boundary arguments are where the known kernel
bugs live: fla PR #955 corrupts the conv dweight with cu_seqlens; causal-conv1d PR #101/#117
read seq_idx out of bounds; causal-conv1d #105 gave a 0.6 max error on sm_103 with CUDA 13.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from contracts.collate import collate_packed
from verify.probe import DOC_LENGTHS, sample_documents


def rel_err(got, want) -> float:
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def segments(lengths):
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out


def compare_fused(fused_fn: Callable, reference_fn: Callable, inputs: dict, dtype) -> dict[str, float]:
    """Run fused(inputs in dtype) and reference(inputs in fp32) forward and backward; relative errors."""
    fused_in = {k: v.detach().to(dtype if v.is_floating_point() and k not in ("g",) else v.dtype).requires_grad_()
                for k, v in inputs.items()}
    ref_in = {k: v.detach().float().requires_grad_() for k, v in inputs.items()}
    out = fused_fn(**fused_in)
    ref = reference_fn(**ref_in)
    torch.manual_seed(0)
    grad_out = torch.randn_like(ref)
    out.backward(grad_out.to(out.dtype))
    ref.backward(grad_out)
    errors = {"out": rel_err(out, ref)}
    for k in inputs:
        errors[f"grad:{k}"] = rel_err(fused_in[k].grad, ref_in[k].grad)
    return errors


def _packed(device):
    return {k: v.to(device) if hasattr(v, "to") else v
            for k, v in collate_packed(sample_documents(DOC_LENGTHS, 512), budget=sum(DOC_LENGTHS),
                                       pad_token_id=0).items()}


def check_causal_conv1d(fused: Callable, torch_ref: Callable, device: str, dtype, **_) -> dict[str, float]:
    seq_idx = _packed(device)["seq_idx"]
    T, D, W = sum(DOC_LENGTHS), 64, 4
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, T, D, generator=gen).to(device)
    weight = (torch.randn(D, W, generator=gen) * 0.5).to(device)

    def run_fused(x, weight):
        # causal-conv1d honours seq_idx only for channel-last x: (B, D, T) with stride(1) == 1,
        # which is exactly what transformers' in_proj(...).transpose(1, 2) produces.
        return fused(x.transpose(1, 2), weight, None, seq_idx=seq_idx, activation="silu")

    def run_reference(x, weight):
        parts = [torch_ref(x[:, s:e].transpose(1, 2), weight, None, activation="silu")
                 for s, e in segments(DOC_LENGTHS)]
        return torch.cat(parts, dim=-1)

    return compare_fused(run_fused, run_reference, {"x": x, "weight": weight}, dtype)


def check_chunk_gated_delta_rule(fused: Callable, torch_ref: Callable, device: str, dtype, **_) -> dict[str, float]:
    cu = _packed(device)["cu_seq_lens_q"]
    T, H, K = sum(DOC_LENGTHS), 4, 32
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {
        "q": torch.randn(1, T, H, K, generator=gen), "k": torch.randn(1, T, H, K, generator=gen),
        "v": torch.randn(1, T, H, K, generator=gen),
        # As in Qwen3_5GatedDeltaNet: g = -A * softplus(.) <= 0 (fp32), beta = sigmoid(.)
        "g": -0.3 * F.softplus(torch.randn(1, T, H, generator=gen)),
        "beta": torch.rand(1, T, H, generator=gen),
    }
    inputs = {k: v.to(device) for k, v in inputs.items()}

    def run_fused(q, k, v, g, beta):
        # transformers calls it with use_qk_l2norm_in_kernel=True and cu_seqlens=cu_seq_lens_q (int32)
        out, _ = fused(q, k, v, g=g.float(), beta=beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        return out

    def run_reference(q, k, v, g, beta):
        parts = []
        for s, e in segments(DOC_LENGTHS):
            o, _ = torch_ref(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                             initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
            parts.append(o)
        return torch.cat(parts, dim=1)

    return compare_fused(run_fused, run_reference, inputs, dtype)


def check_flash_attention(varlen: Callable, device: str, dtype, *, head_dim: int = 256, **_) -> dict[str, float]:
    """At the head dim the image compiled (a specialised build refuses any other)."""
    T, H = sum(DOC_LENGTHS), 2
    cu = torch.tensor([0] + [e for _, e in segments(DOC_LENGTHS)], dtype=torch.int32, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {k: torch.randn(T, H, head_dim, generator=gen).to(device) for k in ("q", "k", "v")}

    def run_fused(q, k, v):
        return varlen(q, k, v, cu, cu, max(DOC_LENGTHS), max(DOC_LENGTHS), dropout_p=0.0, causal=True)

    def run_reference(q, k, v):
        parts = []
        for s, e in segments(DOC_LENGTHS):
            qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))   # (1, H, L, D)
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
        return torch.cat(parts)

    return compare_fused(run_fused, run_reference, inputs, dtype)


CHECKERS = {"causal_conv1d_fn": check_causal_conv1d, "chunk_gated_delta_rule": check_chunk_gated_delta_rule}
