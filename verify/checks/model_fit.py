"""Model fit: the model to be trained needs only what the image's kernels were compiled for.

An image's flash-attn is specialised to its model family (build/resolve/specialise.py): for
Qwen3.5, head dim 256, bf16, without dropout, ALiBi, softcap or sliding window. A model
outside that (another head dim, attention dropout, a sliding window, softcap, fp16 params)
is refused here, naming the mismatch, before any rank starts; the kernel itself would also
refuse it (TORCH_CHECK), but only once training is under way.

The model's facts come from its config.json (the mounted model dir) or, when none is
given, from the family's own attention facts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from contracts.errors import FixableError
from contracts.lock import Specialisation
from families import Family
from verify.context import Context
from verify.report import CheckResult, Status

DTYPE_OF_PARAM = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
REBUILD_GENERIC = ("rebuild the image for this model: set specialise_kernels: false in image.yaml (a generic "
                   "flash-attn), or use the image built for this model's family")


class ModelConfigError(FixableError):
    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """The text-model part of a HF config.json (multimodal configs nest it under text_config)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path} does not exist", "point --model at a HF-format model directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}", "check the model directory") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} is not a JSON object", "check the model directory")
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def model_facts(config: dict[str, Any] | None, family: Family) -> dict[str, Any]:
    """What the model's attention needs, from its config, else from the family's own facts."""
    attention = family.attention
    if config is None:
        return {"head_dim": attention.head_dims[0], "dropout": 0.0, "sliding_window": None, "softcap": None}
    keys = attention.config_keys
    head_dim = config.get(keys.get("head_dim", "head_dim"))
    if head_dim is None and config.get("hidden_size") and config.get("num_attention_heads"):
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    window = config.get(keys.get("sliding_window", "sliding_window"))
    if config.get("use_sliding_window") is False:
        window = None
    return {"head_dim": head_dim, "dropout": config.get(keys.get("dropout", "attention_dropout")) or 0.0,
            "sliding_window": window, "softcap": config.get(keys.get("softcap", "attn_logit_softcapping"))}


def decide_dtype(kernel: str, spec: Specialisation, param_dtype: str) -> CheckResult | None:
    """Pure: the training dtype against what one specialised kernel compiled."""
    if not spec.dtypes:
        return None
    ok = DTYPE_OF_PARAM.get(param_dtype, param_dtype) in spec.dtypes
    return CheckResult(f"model_fit.dtype.{kernel}", Status.PASS if ok else Status.FAIL,
                       f"training runs in {param_dtype}; the image's {kernel} has {', '.join(spec.dtypes)}",
                       "" if ok else f"set parallel.param_dtype to "
                       f"{'bfloat16' if 'bf16' in spec.dtypes else 'float16'}, or " + REBUILD_GENERIC)


def decide_fit(facts: dict[str, Any], spec: Specialisation, param_dtype: str, source: str,
               kernel: str = "flash-attn") -> list[CheckResult]:
    """Pure: one row per fact the attention kernel's specialisation constrains."""
    rows = []
    where = f"({source})"
    head_dim = facts["head_dim"]
    if spec.head_dims:
        ok = head_dim in spec.head_dims
        rows.append(CheckResult("model_fit.head_dim", Status.PASS if ok else Status.FAIL,
                                f"attention head dim {head_dim} {where}; the image's {kernel} has "
                                f"{', '.join(map(str, spec.head_dims))}", "" if ok else REBUILD_GENERIC))
    dtype_row = decide_dtype(kernel, spec, param_dtype)
    if dtype_row:
        rows.append(dtype_row)
    problems = []
    if "dropout" in spec.disabled and float(facts["dropout"] or 0.0) > 0.0:
        problems.append(f"attention_dropout {facts['dropout']} (dropout was compiled out)")
    if "sliding_window" in spec.disabled and facts["sliding_window"] not in (None, 0, -1):
        problems.append(f"sliding window {facts['sliding_window']} (local attention was compiled out)")
    if "softcap" in spec.disabled and facts["softcap"] not in (None, 0, 0.0):
        problems.append(f"attention softcap {facts['softcap']} (softcapping was compiled out)")
    if spec.disabled:
        rows.append(CheckResult("model_fit.features", Status.FAIL if problems else Status.PASS,
                                ("the model needs " + "; ".join(problems)) if problems else
                                f"the model uses none of the features compiled out ({', '.join(spec.disabled)}) "
                                f"{where}", REBUILD_GENERIC if problems else ""))
    return rows


def run(ctx: Context) -> list[CheckResult]:
    if ctx.lock is None and ctx.no_lock:
        model = f" ({ctx.model_source})" if ctx.model_source else ""
        return [CheckResult("model_fit", Status.SKIP, "no lock (--no-lock, an audit): no record of the head dims, "
                            "dtypes and features the image's kernels were compiled for; the fused_ops rows run "
                            f"them at head dim {ctx.probe_head_dim}{model}")]
    specialised = [k for k in (ctx.lock.kernels if ctx.lock else ()) if not k.specialisation.generic]
    if not specialised:
        return [CheckResult("model_fit", Status.SKIP if not (ctx.lock and ctx.lock.kernels) else Status.PASS,
                            "no kernel in the image was specialised: every head dim, dtype and feature they "
                            "support was compiled")]
    attention = ctx.attention_kernel
    rows = []
    if attention is not None and not attention.specialisation.generic:
        source = ctx.model_source or f"family {ctx.family.name} defaults"
        rows += decide_fit(model_facts(ctx.model_config, ctx.family), attention.specialisation, ctx.param_dtype,
                           source, kernel=attention.distribution)
    for kernel in specialised:
        if kernel is not attention:
            row = decide_dtype(kernel.distribution, kernel.specialisation, ctx.param_dtype)
            if row:
                rows.append(row)
    return rows
