"""Fused ops, forward AND backward, on the device: right numbers, right kernels, no torch fallback.

Per op, on packed inputs (the boundary arguments are where the known kernel bugs live: fla PR #955
corrupts the conv dweight with cu_seqlens; causal-conv1d PR #101/#117 read seq_idx out of bounds;
causal-conv1d #105 gave a 0.6 max error on sm_103 with CUDA 13), compare the fused output and the
input/weight gradients with the torch reference run per document in fp32.

Then one training step of the tiny model through transformers (the real dispatch) under
torch.profiler: each fused kernel must appear in the forward AND the backward window, and the
torch reference functions must never be entered. The step's GPU kernel launches are reported.

Needs CUDA. On CPU every row FAILs with "needs CUDA"; nothing here passes by skipping work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from verify.context import Context
from verify.report import CheckResult, Status

OPS = ("causal_conv1d_fn", "chunk_gated_delta_rule", "attention:flash_attention_2")
DOC_LENGTHS = (40, 24, 33)  # boundaries inside a 64-token fla chunk; odd lengths for the conv


@dataclass(frozen=True)
class OpTolerance:
    """Relative max error of the bf16 fused op against the fp32 torch reference."""

    output: float = 2e-2
    grads: float = 5e-2


OP_TOL = OpTolerance()


def needs_cuda_rows(reason: str) -> list[CheckResult]:
    fix = "run verify on a GPU host (docker run --gpus all IMAGE verify)"
    return [CheckResult(f"fused_ops.{op}", Status.FAIL, f"needs CUDA: {reason}", fix) for op in OPS]


def rel_err(got, want) -> float:
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def compare_verdict(op: str, errors: dict[str, float], tol: OpTolerance = OP_TOL) -> CheckResult:
    """Pure: errors maps "out" and "grad:<name>" to relative max errors."""
    row = f"fused_ops.{op}"
    bad = {k: v for k, v in errors.items() if not v <= (tol.output if k == "out" else tol.grads)}
    shown = ", ".join(f"{k} {v:.3g}" for k, v in errors.items())
    if not errors:
        return CheckResult(row, Status.FAIL, "nothing was compared", "report this as a verify bug")
    if bad:
        return CheckResult(row, Status.FAIL, f"fused vs torch reference differs: {shown} (tolerance out "
                           f"{tol.output}, grads {tol.grads}, relative)",
                           "a miscompiled or buggy kernel: rebuild it for this arch, or pin a fixed version", errors)
    return CheckResult(row, Status.PASS, f"forward and backward match the fp32 torch reference: {shown}", errors)


def _segments(lengths):
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out


def _grads(tensors: dict) -> dict:
    return {k: v.grad.detach().clone() for k, v in tensors.items()}


def compare_fused(fused_fn: Callable, reference_fn: Callable, inputs: dict, dtype) -> dict[str, float]:
    """Run fused(inputs in dtype) and reference(inputs in fp32) forward and backward; relative errors."""
    import torch

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


def check_causal_conv1d(fused: Callable, torch_ref: Callable, device: str, dtype) -> dict[str, float]:
    import torch

    from entrypoint.collate import collate_packed
    from verify.tiny_model import sample_documents

    batch = collate_packed(sample_documents(DOC_LENGTHS, 512), budget=sum(DOC_LENGTHS), pad_token_id=0)
    seq_idx = batch["seq_idx"].to(device)
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
                 for s, e in _segments(DOC_LENGTHS)]
        return torch.cat(parts, dim=-1)

    return compare_fused(run_fused, run_reference, {"x": x, "weight": weight}, dtype)


def check_chunk_gated_delta_rule(fused: Callable, torch_ref: Callable, device: str, dtype) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from entrypoint.collate import collate_packed
    from verify.tiny_model import sample_documents

    batch = collate_packed(sample_documents(DOC_LENGTHS, 512), budget=sum(DOC_LENGTHS), pad_token_id=0)
    cu = batch["cu_seq_lens_q"].to(device)
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
        for s, e in _segments(DOC_LENGTHS):
            o, _ = torch_ref(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                             initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
            parts.append(o)
        return torch.cat(parts, dim=1)

    return compare_fused(run_fused, run_reference, inputs, dtype)


def check_flash_attention(varlen: Callable, device: str, dtype) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    T, H, D = sum(DOC_LENGTHS), 4, 32
    cu = torch.tensor([0] + [e for _, e in _segments(DOC_LENGTHS)], dtype=torch.int32, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {k: torch.randn(T, H, D, generator=gen).to(device) for k in ("q", "k", "v")}

    def run_fused(q, k, v):
        return varlen(q, k, v, cu, cu, max(DOC_LENGTHS), max(DOC_LENGTHS), dropout_p=0.0, causal=True)

    def run_reference(q, k, v):
        parts = []
        for s, e in _segments(DOC_LENGTHS):
            qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))   # (1, H, L, D)
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
        return torch.cat(parts)

    return compare_fused(run_fused, run_reference, inputs, dtype)


def profile_tiny_step(ctx: Context, module, resolutions) -> tuple:
    """One fwd+bwd step of the tiny model through transformers, profiled. Returns (StepProfile, model)."""
    import torch

    from entrypoint.collate import collate_packed
    from verify.calltrace import innermost_code
    from verify.kernel_profile import profile_phases
    from verify.packing_probe import token_loss_sum
    from verify.tiny_model import batch_to, build_tiny_model, sample_documents

    try:
        model = build_tiny_model(ctx.family, attn_implementation=ctx.family.attention.implementation,
                                 device=ctx.device, dtype=torch.bfloat16).train()
    except ImportError:
        # Still profile conv and GDN; the attention verdict then FAILs (no flash kernels ran).
        model = build_tiny_model(ctx.family, attn_implementation="sdpa", device=ctx.device,
                                 dtype=torch.bfloat16).train()
    batch = batch_to(collate_packed(sample_documents(DOC_LENGTHS, model.config.vocab_size), budget=112,
                                    pad_token_id=0), ctx.device)
    labels = batch.pop("labels")
    watched = {}
    for fused in ctx.family.required_fused:
        res = resolutions[fused.replaces]
        watched[f"{fused.replaces}:torch"] = innermost_code(res.torch_function) if res.torch_function else None
    from transformers.integrations import sdpa_attention

    watched["attention:torch"] = innermost_code(sdpa_attention.sdpa_attention_forward)
    watched["attention_eager:torch"] = innermost_code(getattr(module, "eager_attention_forward"))

    def forward():
        return token_loss_sum(model(**batch, use_cache=False).logits, labels)

    def backward(loss):
        loss.backward()

    for _ in range(2):  # warm up: Triton JIT and autotuning launch many extra kernels on first calls
        backward(forward())
        model.zero_grad(set_to_none=True)
    return profile_phases(forward, backward, watched, device=ctx.device), model


def run(ctx: Context) -> list[CheckResult]:
    import torch

    if not torch.cuda.is_available():
        return needs_cuda_rows("no CUDA device")
    if not ctx.device.startswith("cuda"):
        return needs_cuda_rows(f"--device {ctx.device} was chosen")
    return run_on_device(ctx)


def run_on_device(ctx: Context) -> list[CheckResult]:
    """The work itself, without the CUDA gate (tests drive it on CPU, where every row must FAIL)."""
    import torch

    from verify.checks.dispatch import read_resolution
    from verify.kernel_profile import kernel_verdict
    from verify.tiny_model import modeling_module

    family = ctx.family
    module = modeling_module(family)
    resolutions = {f.replaces: read_resolution(module, f.wrapper) for f in family.required_fused}
    dtype = torch.bfloat16
    rows: list[CheckResult] = []

    checkers = {"causal_conv1d_fn": check_causal_conv1d, "chunk_gated_delta_rule": check_chunk_gated_delta_rule}
    for fused in family.required_fused:
        res = resolutions[fused.replaces]
        if not res.is_new:
            rows.append(CheckResult(f"fused_ops.{fused.replaces}", Status.FAIL,
                                    "not fused: transformers resolved the torch reference (see dispatch)",
                                    f"install {fused.distribution}; rebuild the image"))
            continue
        rows.append(_guarded(fused.replaces, lambda f=fused, r=res: compare_verdict(
            f.replaces, checkers[f.replaces](r.implementation, r.torch_function, ctx.device, dtype))))

    def attention_row():
        from transformers import modeling_flash_attention_utils as fa_utils
        from transformers.utils import is_flash_attn_2_available

        from verify.checks.dispatch import explain_fallback

        attn = family.attention
        if not is_flash_attn_2_available():
            # Do not let transformers fall through to its Kernel Hub loader (a download).
            why = explain_fallback(attn.package, f"{attn.package}.flash_attn_varlen_func", attn.distribution)
            return CheckResult(f"fused_ops.{attn.replaces}", Status.FAIL, f"flash-attn unavailable: {why}",
                               f"install the lock's {attn.distribution} wheel; rebuild the image")
        (_, varlen, *_), _ = fa_utils.lazy_import_flash_attention(attn.implementation)
        return compare_verdict(family.attention.replaces, check_flash_attention(varlen, ctx.device, dtype))

    rows.append(_guarded(family.attention.replaces, attention_row))

    try:
        step, model = profile_tiny_step(ctx, module, resolutions)
    except Exception as exc:  # noqa: BLE001 - a step that cannot run is the finding
        rows.append(CheckResult("fused_ops.step", Status.FAIL, f"tiny model step failed: {type(exc).__name__}: {exc}",
                                "see the dispatch rows; rebuild the image"))
        return rows
    for fused in family.required_fused:
        rows.append(kernel_verdict(fused.replaces, step.kernels, fused.forward_kernels, fused.backward_kernels,
                                   step.torch_reference_calls.get(f"{fused.replaces}:torch", 0)))
    attn = family.attention
    rows.append(kernel_verdict(attn.replaces, step.kernels, attn.forward_kernels, attn.backward_kernels,
                               step.torch_reference_calls.get("attention:torch", 0)
                               + step.torch_reference_calls.get("attention_eager:torch", 0)))
    if not step.launches:
        rows.append(CheckResult("fused_ops.step", Status.FAIL, f"no GPU kernels were recorded on {ctx.device}",
                                "run on a CUDA device"))
        return rows
    rows.append(CheckResult("fused_ops.step", Status.PASS,
                            f"tiny model train step ({model.config._attn_implementation}): {step.launches} GPU kernel "
                            "launches "
                            f"({len(step.kernels.forward)} forward, {len(step.kernels.backward)} backward)",
                            data={"launches": step.launches, "forward": len(step.kernels.forward),
                                  "backward": len(step.kernels.backward)}))
    return rows


def _guarded(op: str, make_row: Callable[[], CheckResult]) -> CheckResult:
    try:
        return make_row()
    except Exception as exc:  # noqa: BLE001 - e.g. a Triton JIT failure or an undefined symbol
        return CheckResult(f"fused_ops.{op}", Status.FAIL, f"{type(exc).__name__}: {exc}",
                           "the kernel cannot run here: check environment rows (arch, driver, triton runtime)")
