"""Dispatch: which implementation each wrapped transformers function really resolved to.

transformers 5.x wraps causal_conv1d_fn and chunk_gated_delta_rule with
use_kernel_func_from_hub_with_fallback: it tries the installed package ONCE, at import, inside
`except Exception`, and falls back to the torch reference silently; its only warning claims the
package "is not installed" even when the import failed for another reason (integrations/hub_kernels.py).
So we read the real resolution from the wrapper's closure, confirm by watching what the GDN layer
instance calls at run time (the class is also decorated with use_kernelized_func), and re-import
the package ourselves only to explain a fallback with the real exception (families.binding reads
the closure and the exception; the runtime guard reads them there too). A fused function counts
only where verify.provenance says its code came from the kernel's installed distribution, loaded
by the standard loaders and served by no import hook.
"""
from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

from contracts.lock import LockedKernel
from families import Attention, with_batch_adds
from families.binding import Resolution, describe, explain_fallback, read_resolution
from verify.calltrace import watch_calls
from verify.context import Context, FusedNeed
from verify.import_facts import Survey
from verify.provenance import Verdict, judge_kernel, kind_of, refusal
from verify.report import CheckResult, Status

REQUIRES = ("transformers",)   # the modeling code whose dispatch these rows prove

REBUILD = "rebuild the image with `python -m build` so the lock's kernel wheels are installed and importable"


def fallback_fix(need: FusedNeed, package: str, why: str, audit: bool = False) -> str:
    if "raises" in why or "does not resolve" in why:
        return (f"{package} is installed but broken (error in DETAIL): rebuild its wheel against this "
                "image's torch/CUDA (`python -m build`); an undefined symbol means an ABI mismatch")
    if audit:
        return (f"install `{package}` built for this image's torch and CUDA (it backs {need.function} with "
                f"{need.boundary_kwarg}), or build the image with `python -m build`")
    if need.kernel is not None:
        return f"rebuild the image: the lock lists {need.kernel.distribution} but it is not importable"
    return f"add a kernel that replaces {need.function} to the image's kernels and rebuild"


def decide_function(need: FusedNeed, res: Resolution, runtime: dict[str, int] | None, runtime_error: str,
                    why: str, audit: bool = False, *, provenance: Verdict | None) -> CheckResult:
    """Pure decision for one required fused function. `runtime` holds call counts of the fused
    and torch code objects during one packed forward of the probe model (None when not run).
    audit: no lock was read (--no-lock), so a kernel no lock lists is what is being audited.
    provenance: where the resolved implementation came from (None: not read, never a PASS)."""
    lock_kernel: LockedKernel | None = need.kernel
    name = f"dispatch.{need.function}"
    lock_note = (f"lock: {lock_kernel.distribution} {lock_kernel.version}" if lock_kernel
                 else "no lock (--no-lock, an audit)" if audit
                 else f"the lock has no kernel replacing {need.function}")
    package = lock_kernel.import_name if lock_kernel else (res.package or "?")
    if not res.readable:
        return CheckResult(name, Status.FAIL, f"cannot read transformers' resolution: {res.error}",
                           "pin the transformers version verify/ was written for (see lock.transformers)")
    data: dict[str, Any] = {"implementation": describe(res.implementation), "is_new_implementation": res.is_new,
                            "applicable_params": list(res.applicable_params), "runtime_calls": runtime,
                            "provenance": provenance.data if provenance else None}
    if not res.is_new:
        return CheckResult(
            name, Status.FAIL,
            f"torch reference path: {need.wrapper} resolved to {describe(res.implementation)} "
            f"(is_new_implementation=False); why: {why}; {lock_note}; the torch path also drops "
            f"{need.boundary_kwarg}, so packed documents leak",
            fallback_fix(need, package, why, audit), data)
    impl_module = getattr(inspect.unwrap(res.implementation), "__module__", "") or ""
    if not impl_module.startswith(package):
        return CheckResult(
            name, Status.FAIL,
            f"resolved to {describe(res.implementation)}, not the {package} package (Kernel Hub?)",
            "set USE_HUB_KERNELS=0 and use the image's verified wheel", data)
    if refused := refusal(provenance):
        return CheckResult(name, Status.FAIL, f"resolved to {describe(res.implementation)}, but {refused[0]}",
                           refused[1], data)
    if need.boundary_kwarg not in res.applicable_params:
        return CheckResult(
            name, Status.FAIL,
            f"{describe(res.implementation)} takes no `{need.boundary_kwarg}`; transformers drops it, so "
            "packed documents leak", f"install the {package} version pinned in the lock", data)
    if lock_kernel is None and not audit:
        return CheckResult(name, Status.FAIL, f"fused ({describe(res.implementation)}) but {lock_note}",
                           "rebuild the image: an unlocked kernel was not built or checked by build/", data)
    if runtime is None:
        return CheckResult(name, Status.FAIL,
                           f"resolved to {describe(res.implementation)}, but the GDN layer could not be run "
                           f"to confirm: {runtime_error}", "run verify on a CUDA device (--device cuda)", data)
    if runtime.get("torch", 0) or not runtime.get("fused", 0):
        return CheckResult(
            name, Status.FAIL,
            f"resolved to {describe(res.implementation)}, but the GDN layer instance called the torch "
            f"reference {runtime.get('torch', 0)}x and the fused function {runtime.get('fused', 0)}x "
            "(use_kernelized_func/kernelize swapped it)", "do not kernelize the model; set USE_HUB_KERNELS=0",
            data)
    return CheckResult(
        name, Status.PASS,
        f"{describe(res.implementation)} ({lock_note}); the GDN layer called it {runtime['fused']}x, the torch "
        f"reference 0x; `{need.boundary_kwarg}` is accepted; {provenance.detail}", data=data)


def decide_attention(required: Attention, promised: str, build_error: str, model_attn: str | None,
                     varlen_fn: Callable | None, runtime: dict[str, int] | None, why: str,
                     locked: bool = True, package: str = "flash_attn", audit: bool = False, *,
                     provenance: Verdict | None) -> CheckResult:
    """provenance: where varlen_fn came from (None: not read, never a PASS)."""
    name = "dispatch.attention"
    data = {"promised": promised, "model": model_attn, "varlen_fn": describe(varlen_fn), "runtime_calls": runtime,
            "provenance": provenance.data if provenance else None}
    want = required.implementation
    if promised != want:
        return CheckResult(
            name, Status.FAIL,
            f"the lock promises attn_implementation={promised!r}; packed documents need {want!r} "
            "(sdpa/eager are the torch path and only mask packing, flash-attn varlen is the fused kernel)",
            f"build the image with attn_implementation: {want} and the flash-attn wheel", data)
    if build_error:
        fix = (f"install `{package}` built for this image's torch and CUDA, or build the image with `python -m build`"
               if audit else f"install the lock's {package} wheel; " + REBUILD)
        return CheckResult(name, Status.FAIL, f"transformers refused {want}: {build_error}; why: {why}", fix, data)
    if model_attn != want:
        return CheckResult(name, Status.FAIL, f"the model runs {model_attn!r}, not {want!r}",
                           f"pass attn_implementation={want!r} when building the model", data)
    if runtime is None:
        return CheckResult(name, Status.FAIL, f"{want} configured but not run: needs CUDA",
                           "run verify on a CUDA device (--device cuda)", data)
    varlen_module = getattr(inspect.unwrap(varlen_fn), "__module__", "") if varlen_fn else ""
    if not varlen_module.startswith(package):
        return CheckResult(name, Status.FAIL,
                           f"flash attention resolved to {describe(varlen_fn)}, not the {package} "
                           "package (Kernel Hub fallback?)", "install the lock's flash-attn wheel; set "
                           "USE_HUB_KERNELS=0", data)
    if refused := refusal(provenance):
        return CheckResult(name, Status.FAIL, f"flash attention resolved to {describe(varlen_fn)}, but {refused[0]}",
                           refused[1], data)
    if runtime.get("torch", 0) or not runtime.get("fused", 0):
        return CheckResult(name, Status.FAIL,
                           f"attention layers called torch attention {runtime.get('torch', 0)}x and "
                           f"flash_attention_forward {runtime.get('fused', 0)}x", "check config._attn_implementation",
                           data)
    if not locked:
        return CheckResult(name, Status.FAIL, f"{want} runs via {describe(varlen_fn)}, but the lock has no kernel "
                           f"replacing {required.replaces}: an unverified flash-attn", REBUILD, data)
    return CheckResult(name, Status.PASS, f"{want} via {describe(varlen_fn)}; called {runtime['fused']}x, torch "
                       f"attention 0x; {provenance.detail}", data=data)


def decide_kernel_hub(kernels_version: str | None, hub_enabled: bool, model_use_kernels: bool) -> CheckResult:
    name = "dispatch.kernel_hub"
    data = {"kernels": kernels_version, "USE_HUB_KERNELS": hub_enabled, "model.use_kernels": model_use_kernels}
    if model_use_kernels:
        return CheckResult(name, Status.FAIL, "the model was kernelized from the Hub: its layers are not the "
                           "verified wheels, and kernelize silently keeps layers without backward on the torch "
                           "path (transformers PR #41428)", "build the model without use_kernels", data)
    if kernels_version and hub_enabled:
        return CheckResult(name, Status.WARN, f"`kernels` {kernels_version} is installed and USE_HUB_KERNELS is "
                           "on: a later kernelize()/use_kernels=True would swap in unverified Hub kernels",
                           "set USE_HUB_KERNELS=0 in the image, or remove `kernels`", data)
    reason = "`kernels` is not installed" if not kernels_version else "USE_HUB_KERNELS is off"
    return CheckResult(name, Status.PASS, f"Kernel Hub not in play: {reason}", data=data)


def _kernels_state() -> tuple[str | None, bool]:
    # transformers only when the check runs: the runner checks REQUIRES after it imports this module
    from transformers.integrations import hub_kernels

    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return version, bool(getattr(hub_kernels, "_kernels_enabled", False))


def _runtime_probe(ctx: Context, model, module, resolutions: dict[str, Resolution]):
    """One packed forward of the probe model, watching which code objects run."""
    import torch  # see run()

    from verify.probe import packed_batch, watched_code

    batch = with_batch_adds(ctx.family, packed_batch(model.config.vocab_size, ctx.device))
    batch.pop("labels")
    with torch.no_grad(), watch_calls(watched_code(ctx, module, resolutions)) as counts:
        model(**batch, use_cache=False)  # as in training; see packing_probe._run
    return dict(counts)


def run(ctx: Context) -> list[CheckResult]:
    # torch, and the modules that import it, only inside run(): the runner imports this module outside
    # the try that makes a crash a FAIL row
    import torch

    from families.runtime import modeling_module, probe_dtype
    from verify.probe import build_probe_model

    family = ctx.family
    module = modeling_module(family)  # transformers resolves kernels here, at import
    needs = ctx.needs()
    resolutions = {n.function: read_resolution(module, n.wrapper) for n in needs}
    attention = ctx.attention_kernel
    attn_package = attention.import_name if attention else "flash_attn"

    attn_error, attn_why = "", ""
    wanted_attn = ctx.attn_implementation
    dtype = probe_dtype(ctx.device)
    model, runtime, runtime_error = None, None, ""
    if ctx.device.startswith("cuda") and not torch.cuda.is_available():
        runtime_error = "needs CUDA: --device cuda but no CUDA device"
    else:
        try:
            model = build_probe_model(ctx, attn_implementation=wanted_attn, dtype=dtype)
        except ImportError as exc:  # transformers refuses flash_attention_2 when flash_attn is unusable
            attn_error = str(exc)
            attn_why = explain_fallback(attn_package, f"{attn_package}.flash_attn_varlen_func",
                                        attention.distribution if attention else "flash-attn")
            model = build_probe_model(ctx, attn_implementation="sdpa", dtype=dtype)
        try:
            runtime = _runtime_probe(ctx, model, module, resolutions)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is exactly what we report
            runtime_error = f"{type(exc).__name__}: {exc}"
    model_attn = model.config._attn_implementation if model is not None else wanted_attn

    rows = []
    survey = Survey()
    for need in needs:
        res = resolutions[need.function]
        package = need.kernel.import_name if need.kernel else res.package
        symbol = need.symbol or f"{package}.{need.function}"
        distribution = need.kernel.distribution if need.kernel else package
        why = "" if (res.is_new or not res.readable) else explain_fallback(package, symbol, distribution)
        per_fn = None if runtime is None else {
            "torch": runtime[f"{need.function}:torch"], "fused": runtime[f"{need.function}:fused"]}
        origin = judge_kernel(survey.function_facts(res.implementation, *kind_of(package, ctx.lock))) \
            if res.is_new else None
        rows.append(decide_function(need, res, per_fn, runtime_error, why, audit=ctx.no_lock, provenance=origin))

    attn_runtime = None
    if runtime is not None and model_attn == family.attention.implementation:
        attn_runtime = {"torch": runtime["attention:torch_sdpa"] + runtime["attention:torch_eager"],
                        "fused": runtime["attention:fused"]}
    from transformers import modeling_flash_attention_utils as fa_utils  # as in _kernels_state

    varlen = fa_utils._flash_varlen_fn
    attn_origin = judge_kernel(survey.function_facts(varlen, *kind_of(attn_package, ctx.lock))) if varlen else None
    rows.append(decide_attention(family.attention, wanted_attn, attn_error,
                                 None if attn_error else model_attn, varlen, attn_runtime, attn_why,
                                 locked=attention is not None or ctx.no_lock, package=attn_package,
                                 audit=ctx.no_lock, provenance=attn_origin))
    if family.experts is not None:
        rows.append(_experts(ctx, model, runtime_error))
    kernels_version, hub_enabled = _kernels_state()
    rows.append(decide_kernel_hub(kernels_version, hub_enabled, bool(getattr(model, "use_kernels", False))))
    if runtime_error and all(r.status != Status.FAIL for r in rows):
        rows.append(CheckResult("dispatch.runtime", Status.FAIL, f"probe model forward failed: {runtime_error}",
                                REBUILD))
    return rows


def _experts(ctx: Context, model, runtime_error: str) -> CheckResult:
    """`dispatch.experts`: which experts implementation one packed step of the probe model ran,
    forward and backward (verify.experts_path); a per-expert fallback FAILs as a torch fallback does."""
    from verify.experts_path import experts_row  # torch: only when the check runs, as in run()

    if model is None:
        return CheckResult("dispatch.experts", Status.FAIL, f"the probe model could not be built: {runtime_error}",
                           REBUILD)
    row = experts_row(ctx.family, model, ctx.device)
    return CheckResult("dispatch.experts", row.status, row.detail, row.fix, row.data)
