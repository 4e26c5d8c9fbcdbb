"""Isolation: packed documents must not see each other, in forward AND backward, per layer kind.

The probe (verify/packing_probe.py) runs the tiny model on documents packed the way
contracts.collate packs them, and on the same documents one at a time. Each layer kind is
compared on identical inputs (teacher forcing), so a leak is attributed to the kind that causes
it. A negative control withholds the boundary information: if that does not change the output
either, the probe cannot see a leak and the check FAILs as blind rather than passing. And the
probe proves the kernels only where they are the image's: when verify.provenance refuses a fused
function the model ran (an import hook served it, or its files are in no installed RECORD), every
row FAILs, since that hook's code ran in this process and in the model's forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from families import MEASURES
from families.binding import read_resolution
from verify.context import Context
from verify.import_facts import Survey
from verify.provenance import Verdict, judge_kernel, kind_of
from verify.report import CheckResult, Status

REQUIRES = ("transformers",)   # the modeling code whose dispatch these rows prove


@dataclass(frozen=True)
class Tolerance:
    """Relative max differences (see packing_probe.Measurement)."""

    layer: float      # a layer kind, packed vs separate, identical inputs
    logits: float
    grads: float
    blind: float      # the negative control must differ by MORE than this, or the probe is blind


# fp32 on CPU: a correct setup stays at float noise (below 1e-5; measured ~1e-7 for sdpa
# attention). bf16 on GPU: ~3 significant digits per op, 4 layers deep.
TOLERANCES = {
    "float32": Tolerance(layer=1e-4, logits=1e-4, grads=1e-4, blind=1e-2),
    "bfloat16": Tolerance(layer=2e-2, logits=3e-2, grads=5e-2, blind=1.5e-1),
}

KIND_FIX = {
    "attention": "use attn_implementation=flash_attention_2 (varlen, cu_seq_lens_q/k from contracts.collate) and "
                 "call the model with use_cache=False",
    "gdn": "install flash-linear-attention so chunk_gated_delta_rule honours cu_seqlens (the torch fallback "
           "ignores it)",
    "conv": "install causal-conv1d so causal_conv1d_fn honours seq_idx (the torch fallback drops it); pass "
            "seq_idx from contracts.collate.collate_packed",
    "kda": "install flash-linear-attention so chunk_kda honours cu_seqlens (the torch fallback ignores it), and "
           "pass cu_seqlens: the pinned Kimi Linear code never maps cu_seq_lens_q to it (our trainer adds it)",
    "ssd": "install mamba-ssm so the Mamba2 chunk scan honours seq_idx (the torch fallback drops it), and pass "
           "seq_idx with every packed batch: the model never derives it from position_ids",
}
KIND_WHAT = {"attention": "full-attention output", "gdn": "gated delta rule (mixer output, conv forced)",
             "kda": "Kimi delta attention (mixer output, conv forced)",
             "ssd": "Mamba2 SSD chunk scan (mixer output, conv forced)", "conv": "causal conv1d output"}


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.3g}"


def decide_kind(kind: str, packed: float, withheld: float, tol: Tolerance, *, packed_abs: float = float("nan"),
                withheld_abs: float = float("nan"), note: str = "") -> CheckResult:
    """Pure decision for one layer kind from relative differences."""
    row = f"isolation.{kind}"
    data = {"packed_rel": packed, "withheld_rel": withheld, "packed_abs": packed_abs, "withheld_abs": withheld_abs,
            "tolerance": tol.layer, "blind_threshold": tol.blind}
    numbers = (f"{KIND_WHAT[kind]}: packed vs separate max diff {_fmt(packed)} rel ({_fmt(packed_abs)} abs); "
               f"negative control (boundaries withheld) {_fmt(withheld)} rel")
    suffix = f"; {note}" if note else ""
    if math.isnan(packed) or math.isnan(withheld):
        return CheckResult(row, Status.FAIL, f"no {kind} layer was measured{suffix}",
                           "the probe model must contain every layer kind; fix the family's probe flavour", data)
    if not withheld > tol.blind:
        return CheckResult(row, Status.FAIL, f"probe blind: {numbers} <= {tol.blind}, so this probe cannot "
                           f"see a {kind} leak{suffix}", "fix the probe (documents, model init) before trusting it",
                           data)
    if not packed <= tol.layer:
        return CheckResult(row, Status.FAIL, f"leak: {numbers}; tolerance {tol.layer}{suffix}", KIND_FIX[kind], data)
    return CheckResult(row, Status.PASS, f"isolated: {numbers}; tolerance {tol.layer}{suffix}", data=data)


def decide_end_to_end(logits: float, logits_withheld: float, grads: float, worst_param: str,
                      tol: Tolerance, *, logits_abs: float = float("nan")) -> list[CheckResult]:
    data = {"logits_rel": logits, "logits_abs": logits_abs, "logits_withheld_rel": logits_withheld,
            "grads_rel": grads, "grads_worst_param": worst_param, "tolerance_logits": tol.logits,
            "tolerance_grads": tol.grads, "blind_threshold": tol.blind}
    control = f"negative control {_fmt(logits_withheld)} rel"
    if not logits_withheld > tol.blind:
        blind = CheckResult("isolation.logits", Status.FAIL,
                            f"probe blind: withholding the boundaries changed the logits by only "
                            f"{_fmt(logits_withheld)} rel (<= {tol.blind}); nothing this probe says can be trusted",
                            "fix the probe (documents, model init) before trusting it", data)
        return [blind, CheckResult("isolation.grads", Status.FAIL, "not judged: the probe is blind",
                                   "see isolation.logits", data)]
    rows = []
    if logits <= tol.logits:
        rows.append(CheckResult("isolation.logits", Status.PASS,
                                f"packed logits match separate: {_fmt(logits)} rel <= {tol.logits}; {control}",
                                data=data))
    else:
        rows.append(CheckResult("isolation.logits", Status.FAIL,
                                f"packed logits differ from separate: {_fmt(logits)} rel ({_fmt(logits_abs)} abs) "
                                f"> {tol.logits}; {control}", "see the per-kind isolation rows", data))
    if grads <= tol.grads:
        rows.append(CheckResult("isolation.grads", Status.PASS,
                                f"parameter gradients match: {_fmt(grads)} rel <= {tol.grads}", data=data))
    else:
        rows.append(CheckResult("isolation.grads", Status.FAIL,
                                f"parameter gradients differ: {_fmt(grads)} rel > {tol.grads} (worst: {worst_param})",
                                "see the per-kind isolation rows", data))
    return rows


def conv_plumbing_note(kwargs_seen: tuple[str, ...], applicable_params: tuple[str, ...]) -> str:
    """Say whether seq_idx reached causal_conv1d_fn through the model's kwargs, and whether the
    implementation transformers resolved keeps it (its wrapper drops unknown kwargs)."""
    if "seq_idx" not in kwargs_seen:
        return ("seq_idx did NOT reach causal_conv1d_fn: this transformers does not plumb the model's kwargs "
                "to the GDN conv, so the conv cannot isolate documents")
    if "seq_idx" in applicable_params:
        return "seq_idx reached causal_conv1d_fn through the model kwargs and the resolved kernel takes it"
    return ("seq_idx reached causal_conv1d_fn through the model kwargs, but the resolved implementation has "
            "no seq_idx parameter, so transformers' wrapper drops it (torch fallback)")


def judge(measurement, tol: Tolerance, conv_note: str = "", kinds=("attention", "gdn", "conv")) -> list[CheckResult]:
    rows = [decide_kind(kind, measurement.packed.get(kind, float("nan")), measurement.withheld.get(kind, float("nan")),
                        tol, packed_abs=measurement.packed_abs.get(kind, float("nan")),
                        withheld_abs=measurement.withheld_abs.get(kind, float("nan")),
                        note=conv_note if kind == "conv" else "")
            for kind in kinds]
    rows.extend(decide_end_to_end(measurement.logits, measurement.logits_withheld, measurement.grads_rel,
                                  measurement.grads_worst_param, tol, logits_abs=measurement.logits_abs))
    return rows


def with_provenance(rows: list[CheckResult], verdicts: dict[str, Verdict]) -> list[CheckResult]:
    """Pure: every row FAILs when any fused function the probe ran is not the image's own kernel
    (what it measured is that code's isolation, not the kernels'); else the rows say where they came from."""
    refused = {what: v for what, v in verdicts.items() if not v.ok}
    if not refused:
        note = ", ".join(f"{what} from {v.data.get('distribution')}" for what, v in verdicts.items())
        return [CheckResult(r.check, r.status, f"{r.detail}; fused: {note}" if note else r.detail, r.fix, r.data)
                for r in rows]
    what, worst = next(iter(refused.items()))
    return [CheckResult(r.check, Status.FAIL, f"not the image's kernels: {what}: {worst.detail}; measured: {r.detail}",
                        worst.fix, {**r.data, "provenance": {w: v.data for w, v in refused.items()}}) for r in rows]


def run(ctx: Context) -> list[CheckResult]:
    # torch, and the modules that import it, only when the check runs: the runner imports this module
    # outside the try that makes a crash a FAIL row
    import torch

    from families.runtime import hooks, modeling_module, probe_dtype
    from verify.packing_probe import conv_wrapper_of, measure
    from verify.probe import build_probe_model

    if ctx.device.startswith("cuda") and not torch.cuda.is_available():
        return [CheckResult("isolation", Status.FAIL, "needs CUDA: --device cuda but no CUDA device",
                            "run on a GPU host, or --device cpu to probe the torch path")]
    family = ctx.family
    module = modeling_module(family)
    dtype = probe_dtype(ctx.device)
    note = ""
    try:
        model = build_probe_model(ctx, attn_implementation=ctx.attn_implementation, dtype=dtype)
    except ImportError as exc:
        # Still measure the GDN and conv kinds; the attention row says what it ran on.
        note = f"{ctx.attn_implementation} unavailable ({type(exc).__name__}, see dispatch.attention)"
        model = build_probe_model(ctx, attn_implementation="sdpa", dtype=dtype)
    hooks(family).prepare_probe_model(model)
    try:
        m = measure(model, module, family, device=ctx.device)
    except RuntimeError as exc:
        # a kernel that refuses or fails mid-probe (e.g. fla's backward on Hopper with an old Triton,
        # or a CUDA-only kernel asked to run on CPU) is a finding about this machine, not a verify bug
        reason = str(exc).splitlines()[0][:300]
        fix = ("run on a CUDA device: the installed fused kernels run only there" if "cuda" in reason.lower()
               and not ctx.device.startswith("cuda") else "see the environment.runtime and fused_ops rows")
        return [CheckResult("isolation", Status.FAIL, f"the probe could not run: the fused path raised "
                            f"{type(exc).__name__}: {reason}", fix)]
    tol = TOLERANCES[str(dtype).removeprefix("torch.")]
    conv_wrapper = conv_wrapper_of(family)
    note_conv = conv_plumbing_note(m.conv_kwargs_seen, read_resolution(module, conv_wrapper).applicable_params) \
        if conv_wrapper else ""
    kinds = tuple(k for k in MEASURES if any(k in kind.measure for kind in family.layer_kinds.values()))
    rows = judge(m, tol, conv_note=note_conv, kinds=kinds)
    attn_note = f"attention ran {model.config._attn_implementation} on {ctx.device} ({dtype})"
    if note:
        attn_note += f"; {note}"
    rows[0] = CheckResult(rows[0].check, rows[0].status, f"{rows[0].detail}; {attn_note}", rows[0].fix, rows[0].data)
    return with_provenance(rows, _verdicts(ctx, module, model))


def _verdicts(ctx: Context, module, model) -> dict[str, Verdict]:
    """Where each fused function the probe ran came from (the torch fallbacks are transformers' own)."""
    survey, found = Survey(), {}
    for fused in ctx.family.fused_functions:
        res = read_resolution(module, fused.wrapper)
        if res.is_new:
            found[fused.function] = judge_kernel(survey.function_facts(res.implementation,
                                                                        *kind_of(res.package, ctx.lock)))
    if model.config._attn_implementation == "flash_attention_2":
        from transformers import modeling_flash_attention_utils as fa_utils  # only when the check runs

        package = ctx.attention_kernel.import_name if ctx.attention_kernel else "flash_attn"
        if fa_utils._flash_varlen_fn is not None:
            found["attention"] = judge_kernel(survey.function_facts(fa_utils._flash_varlen_fn,
                                                                    *kind_of(package, ctx.lock)))
    return found
