import pytest
import torch
import torch.nn.functional as F

from families import load_family
from families.runtime import modeling_module
from tests.fixtures.locks import manifest_kernel
from verify import op_numerics
from verify.checks import fused_ops
from verify.context import Context, FusedNeed
from verify.kernel_profile import PhaseKernels, kernel_verdict, matching
from verify.report import Status

pytestmark = pytest.mark.unit
FAMILY = load_family("qwen3_5_text")
CONV = FusedNeed("causal_conv1d_fn", "causal_conv1d_fn", "seq_idx", manifest_kernel("causal-conv1d"))
GDN = FusedNeed("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule", "cu_seqlens",
                manifest_kernel("flash-linear-attention", distribution="fla-core"))
FLASH = manifest_kernel("flash-attn")
MODULE = modeling_module(FAMILY)
CONV_REF = MODULE.causal_conv1d_fn.__wrapped__
GDN_REF = MODULE.torch_chunk_gated_delta_rule.__wrapped__

# Kernel names as torch.profiler reports them on a GPU (demangled CUDA templates, Triton names).
FUSED_STEP = PhaseKernels(
    forward=("void causal_conv1d_channellast_fwd_kernel<Causal_conv1d_channellast_fwd_kernel_traits<128, 4, 64, "
             "true, c10::BFloat16, c10::BFloat16> >(ConvParamsBase)",
             "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_fwd_kernel_o",
             "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<32, 128, 128, 4> >(Flash_fwd_params)",
             "ampere_bf16_s16816gemm_bf16_128x64"),
    backward=("void causal_conv1d_channellast_bwd_kernel<...>(ConvParamsBwd)",
              "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
              "void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(Flash_bwd_params)"),
)


def test_profile_verdict_passes_only_with_forward_and_backward_kernels():
    row = kernel_verdict("causal_conv1d_fn", FUSED_STEP, CONV.forward_kernels, CONV.backward_kernels, 0)
    assert row.status is Status.PASS, row.detail
    assert kernel_verdict("chunk_gated_delta_rule", FUSED_STEP, GDN.forward_kernels, GDN.backward_kernels,
                          0).status is Status.PASS
    assert kernel_verdict("attention", FUSED_STEP, FLASH.profile_kernels["forward"], FLASH.profile_kernels["backward"],
                          0).status is Status.PASS


def test_profile_verdict_fails_when_backward_is_not_fused():
    # e.g. a kernel with no backward that kernelize silently kept on torch for training (PR #41428)
    step = PhaseKernels(forward=FUSED_STEP.forward, backward=("void at::native::conv_depthwise2d_backward_kernel",))
    row = kernel_verdict("causal_conv1d_fn", step, CONV.forward_kernels, CONV.backward_kernels, 0)
    assert row.status is Status.FAIL and "no backward kernel" in row.detail and "conv_depthwise2d" in row.detail


def test_profile_verdict_fails_when_the_torch_reference_ran():
    row = kernel_verdict("causal_conv1d_fn", FUSED_STEP, CONV.forward_kernels, CONV.backward_kernels, 2)
    assert row.status is Status.FAIL and "torch reference ran 2x" in row.detail


def test_profile_verdict_on_a_torch_only_step():
    step = PhaseKernels(forward=("void at::native::elementwise_kernel<...>", "aten::conv1d"), backward=())
    row = kernel_verdict("chunk_gated_delta_rule", step, GDN.forward_kernels, GDN.backward_kernels, 0)
    assert row.status is Status.FAIL and "no forward kernel" in row.detail


def test_matching_is_substring_based():
    assert matching(["a_chunk_gated_delta_rule_fwd_kernel_h_x", "other"], ["chunk_gated_delta_rule_fwd_kernel_h"]) == \
        ["a_chunk_gated_delta_rule_fwd_kernel_h_x"]
    assert matching(["x"], []) == []


def test_compare_verdict_thresholds():
    assert fused_ops.compare_verdict("x", {"out": 1e-3, "grad:x": 1e-2}).status is Status.PASS
    bad = fused_ops.compare_verdict("x", {"out": 0.6, "grad:x": 1e-2})
    assert bad.status is Status.FAIL and "out 0.6" in bad.detail
    assert fused_ops.compare_verdict("x", {"out": float("nan")}).status is Status.FAIL
    assert fused_ops.compare_verdict("x", {}).status is Status.FAIL


def _seq_conv(x, weight, bias=None, seq_idx=None, activation=None):
    """A CPU stand-in for causal-conv1d that honours seq_idx (the contract the kernel must meet)."""
    ids = seq_idx[0].tolist()
    cuts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
    return torch.cat([CONV_REF(x[..., s:e], weight, bias, activation) for s, e in zip(cuts, cuts[1:])], dim=-1)


def test_conv_numerics_on_real_tensors():
    good = op_numerics.check_causal_conv1d(_seq_conv, CONV_REF, "cpu", torch.float32)
    assert fused_ops.compare_verdict("causal_conv1d_fn", good).status is Status.PASS, good

    def ignores_seq_idx(x, weight, bias=None, seq_idx=None, activation=None):
        return CONV_REF(x, weight, bias, activation)

    leaky = op_numerics.check_causal_conv1d(ignores_seq_idx, CONV_REF, "cpu", torch.float32)
    row = fused_ops.compare_verdict("causal_conv1d_fn", leaky)
    assert row.status is Status.FAIL and leaky["out"] > 0.05 and leaky["grad:weight"] > 0.05


def test_gdn_numerics_on_real_tensors():
    def per_segment(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                    cu_seqlens=None):
        cuts = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        return torch.cat([GDN_REF(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for s, e in cuts], 1), None

    good = op_numerics.check_chunk_gated_delta_rule(per_segment, GDN_REF, "cpu", torch.float32)
    assert fused_ops.compare_verdict("chunk_gated_delta_rule", good).status is Status.PASS, good
    # the torch fallback: cu_seqlens swallowed by **kwargs, the state flows across documents
    leaky = op_numerics.check_chunk_gated_delta_rule(GDN_REF, GDN_REF, "cpu", torch.float32)
    assert fused_ops.compare_verdict("chunk_gated_delta_rule", leaky).status is Status.FAIL


def test_flash_attention_numerics_on_real_tensors():
    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):
        cuts = list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()))
        return torch.cat([F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)),
                                                         is_causal=causal)[0].transpose(0, 1) for s, e in cuts])

    def not_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):
        return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                              is_causal=causal)[0].transpose(0, 1)

    good = op_numerics.check_flash_attention(varlen, "cpu", torch.float32)
    assert fused_ops.compare_verdict("attention", good).status is Status.PASS, good
    bad = op_numerics.check_flash_attention(not_varlen, "cpu", torch.float32)
    assert fused_ops.compare_verdict("attention", bad).status is Status.FAIL


def test_on_cpu_every_fused_op_fails_with_needs_cuda(env_lock):
    rows = fused_ops.run(Context(lock=env_lock, device="cpu", family=FAMILY))
    assert [r.check for r in rows] == [f"fused_ops.{op}" for op in FAMILY.needs()]
    assert all(r.status is Status.FAIL and r.detail.startswith("needs CUDA") for r in rows)


def test_device_path_runs_end_to_end_on_cpu_and_fails_every_row(env_lock):
    """The GPU code path, driven on CPU: it must run without crashing and never PASS."""
    rows = fused_ops.run_on_device(Context(lock=env_lock, device="cpu", family=FAMILY))
    by_check = {r.check: r for r in rows}
    assert all(r.status is Status.FAIL for r in rows), [(r.check, r.status) for r in rows]
    assert "not fused" in by_check["fused_ops.causal_conv1d_fn"].detail
    assert "flash-attn unavailable" in by_check["fused_ops.attention:flash_attention_2"].detail
    profile = by_check["fused_ops.profile.chunk_gated_delta_rule"]
    assert profile.data["torch_reference_calls"] == 2 and "torch reference ran 2x" in profile.detail
    assert "no GPU kernels were recorded" in by_check["fused_ops.step"].detail
