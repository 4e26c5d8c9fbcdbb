"""Fused ops, forward AND backward, on the device: right numbers, right kernels, no torch fallback.

Per op, on packed inputs, the fused output and the input/weight gradients are compared with the
torch reference run per document in fp32 (op_numerics.py).

Then one training step of the probe model through transformers (the real dispatch) under
torch.profiler: each fused kernel must appear in the forward AND the backward window, and the
torch reference functions must never be entered. The step's GPU kernel launches are reported.

Needs CUDA. On CPU every row FAILs with "needs CUDA"; nothing here passes by skipping work.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from families.binding import explain_fallback, read_resolution
from verify.context import Context
from verify.report import CheckResult, Status

REQUIRES = ("transformers",)   # the modeling code whose dispatch these rows prove


@dataclass(frozen=True)
class OpTolerance:
    """Relative max error of the bf16 fused op against the fp32 torch reference."""

    output: float = 2e-2
    grads: float = 5e-2


OP_TOL = OpTolerance()


def needs_cuda_rows(reason: str, ops: tuple[str, ...]) -> list[CheckResult]:
    fix = "run verify on a GPU host (docker run --gpus all IMAGE verify)"
    return [CheckResult(f"fused_ops.{op}", Status.FAIL, f"needs CUDA: {reason}", fix) for op in ops]


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
                           "a miscompiled or buggy kernel: rebuild it for this arch, or pin a fixed version",
                           data=errors)
    return CheckResult(row, Status.PASS, f"forward and backward match the fp32 torch reference: {shown}",
                       data=errors)


def unnamed_kernel_verdict(op: str, kernels, torch_reference_calls: int) -> CheckResult:
    """Pure: the profile row when no lock names the op's GPU kernels (--no-lock): the torch
    reference must still never be entered; the names themselves are not matched."""
    row = f"fused_ops.profile.{op}"
    data = {"torch_reference_calls": torch_reference_calls, "forward_kernels": len(kernels.forward),
            "backward_kernels": len(kernels.backward)}
    if torch_reference_calls:
        return CheckResult(row, Status.FAIL, f"the torch reference ran {torch_reference_calls}x in the train step",
                           "the fused path did not run end to end; see the dispatch rows", data)
    return CheckResult(row, Status.SKIP, f"no lock names {op}'s GPU kernels (--no-lock, an audit), so none is matched "
                       f"by name; the torch reference ran 0x ({len(kernels.forward)} forward, "
                       f"{len(kernels.backward)} backward GPU kernels)", data=data)


def profile_probe_step(ctx: Context, module, resolutions) -> tuple:
    """One fwd+bwd step of the probe model through transformers, profiled. Returns (StepProfile, model)."""
    import torch  # see run()

    from verify.kernel_profile import profile_phases
    from verify.probe import build_probe_model, packed_batch, token_loss_sum, watched_code

    try:
        model = build_probe_model(ctx, attn_implementation=ctx.family.attention.implementation,
                                  dtype=torch.bfloat16).train()
    except ImportError:
        # Still profile conv and GDN; the attention verdict then FAILs (no flash kernels ran).
        model = build_probe_model(ctx, attn_implementation="sdpa", dtype=torch.bfloat16).train()
    batch = packed_batch(model.config.vocab_size, ctx.device)
    labels = batch.pop("labels")
    watched = {k: v for k, v in watched_code(ctx, module, resolutions).items() if not k.endswith(":fused")}

    def forward():
        return token_loss_sum(model(**batch, use_cache=False).logits, labels)

    def backward(loss):
        loss.backward()

    for _ in range(2):  # warm up: Triton JIT and autotuning launch many extra kernels on first calls
        backward(forward())
        model.zero_grad(set_to_none=True)
    return profile_phases(forward, backward, watched, device=ctx.device), model


def run(ctx: Context) -> list[CheckResult]:
    # torch, and the modules that import it, only when the check runs: the runner imports this module
    # outside the try that makes a crash a FAIL row
    import torch

    if not torch.cuda.is_available():
        return needs_cuda_rows("no CUDA device", ctx.family.needs())
    if not ctx.device.startswith("cuda"):
        return needs_cuda_rows(f"--device {ctx.device} was chosen", ctx.family.needs())
    return run_on_device(ctx)


def run_on_device(ctx: Context) -> list[CheckResult]:
    """The work itself, without the CUDA gate (tests drive it on CPU, where every row must FAIL)."""
    import torch  # see run()

    from families.runtime import modeling_module
    from verify.kernel_profile import kernel_verdict
    from verify.op_numerics import CHECKERS, check_flash_attention

    family = ctx.family
    module = modeling_module(family)
    needs = ctx.needs()
    resolutions = {n.function: read_resolution(module, n.wrapper) for n in needs}
    dtype = torch.bfloat16
    rows: list[CheckResult] = []

    for need in needs:
        res = resolutions[need.function]
        if not res.is_new:
            rows.append(CheckResult(f"fused_ops.{need.function}", Status.FAIL,
                                    "not fused: transformers resolved the torch reference (see dispatch)",
                                    "install the image's kernel for it; rebuild the image"))
            continue
        rows.append(_guarded(need.function, lambda n=need, r=res: compare_verdict(
            n.function, CHECKERS[n.function](r.implementation, r.torch_function, ctx.device, dtype))))

    attention = ctx.attention_kernel

    def attention_row():
        # transformers only here, inside _guarded: the runner checks REQUIRES after it imports this module
        from transformers import modeling_flash_attention_utils as fa_utils
        from transformers.utils import is_flash_attn_2_available

        attn = family.attention
        if not is_flash_attn_2_available():
            # Do not let transformers fall through to its Kernel Hub loader (a download).
            package = attention.import_name if attention else "flash_attn"
            why = explain_fallback(package, f"{package}.flash_attn_varlen_func",
                                   attention.distribution if attention else "flash-attn")
            return CheckResult(f"fused_ops.{attn.replaces}", Status.FAIL, f"flash-attn unavailable: {why}",
                               "install the lock's flash-attn wheel; rebuild the image")
        (_, varlen, *_), _ = fa_utils.lazy_import_flash_attention(attn.implementation)
        return compare_verdict(attn.replaces, check_flash_attention(varlen, ctx.device, dtype,
                                                                    head_dim=ctx.probe_head_dim))

    rows.append(_guarded(family.attention.replaces, attention_row))

    try:
        step, model = profile_probe_step(ctx, module, resolutions)
    except Exception as exc:  # noqa: BLE001 - a step that cannot run is the finding
        rows.append(CheckResult("fused_ops.step", Status.FAIL, f"probe model step failed: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:300]}",
                                "see the environment.runtime and dispatch rows; rebuild the image"))
        return rows
    def verdict(op, forward, backward, torch_calls):
        if ctx.no_lock and not (forward or backward):
            return unnamed_kernel_verdict(op, step.kernels, torch_calls)
        return kernel_verdict(op, step.kernels, forward, backward, torch_calls)

    for need in needs:
        rows.append(verdict(need.function, need.forward_kernels, need.backward_kernels,
                            step.torch_reference_calls.get(f"{need.function}:torch", 0)))
    profile = attention.profile_kernels if attention else {}
    rows.append(verdict(family.attention.replaces, tuple(profile.get("forward", ())),
                        tuple(profile.get("backward", ())),
                        step.torch_reference_calls.get("attention:torch_sdpa", 0)
                        + step.torch_reference_calls.get("attention:torch_eager", 0)))
    if not step.launches:
        rows.append(CheckResult("fused_ops.step", Status.FAIL, f"no GPU kernels were recorded on {ctx.device}",
                                "run on a CUDA device"))
        return rows
    rows.append(CheckResult("fused_ops.step", Status.PASS,
                            f"probe model train step ({model.config._attn_implementation}): {step.launches} GPU "
                            f"kernel launches ({len(step.kernels.forward)} forward, {len(step.kernels.backward)} "
                            "backward)", data={"launches": step.launches, "forward": len(step.kernels.forward),
                                               "backward": len(step.kernels.backward)}))
    return rows


def _guarded(op: str, make_row: Callable[[], CheckResult]) -> CheckResult:
    try:
        return make_row()
    except Exception as exc:  # noqa: BLE001 - e.g. a Triton JIT failure or an undefined symbol
        return CheckResult(f"fused_ops.{op}", Status.FAIL, f"{type(exc).__name__}: {exc}",
                           "the kernel cannot run here: check environment rows (arch, driver, triton runtime)")
