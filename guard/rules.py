"""The guard's decisions, as pure functions: one call of a fused function or of the attention in a
training step, against the batch it belongs to. Each gives what is wrong (a Violation: the layer
kind and what ran or what was missing, with the fix for common trainers) or what the fallback
override let through. No torch here: the wrappers gather the facts."""
from __future__ import annotations

from dataclasses import dataclass

from guard.settings import ALLOW_FALLBACK_ENV

FIX_BOUNDARIES = (
    "pass the document boundaries down the model's kwargs, as these do:",
    "TRL: `SFTConfig(padding_free=True)` (on by default with `packing=True`, BFD) passes cu_seq_lens_q/k and seq_idx",
    "transformers: `DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)`",
    "this image's `finetune`: its collator builds all of them")
FIX_ATTENTION = (
    'load the model with `attn_implementation="flash_attention_2"` (TRL: `SFTConfig(model_init_kwargs='
    '{"attn_implementation": "flash_attention_2"})`; or `from_pretrained(..., attn_implementation='
    '"flash_attention_2")`), and with TRL keep `padding_free=True` (or BFD packing)',)
FIX_UNPACKED = (f"or, slowly, train on padded unpacked batches (TRL `packing=False, padding_free=False`) with "
                f"{ALLOW_FALLBACK_ENV}=1",)


@dataclass(frozen=True)
class Violation:
    function: str      # "causal_conv1d_fn", "chunk_gated_delta_rule", "attention"
    message: str
    fix: tuple[str, ...]      # one line each; the refusal prints every distinct line once


@dataclass(frozen=True)
class Call:
    """The facts about one call of a fused function in a training step."""

    function: str                  # the family's name, e.g. chunk_gated_delta_rule
    wrapper: str                   # the modeling module's attribute, e.g. torch_chunk_gated_delta_rule
    kind: str                      # the layer kind, e.g. linear_attention
    boundary_kwarg: str            # e.g. cu_seqlens
    bound: str                     # module.qualname of what transformers bound
    fused: bool                    # transformers bound the kernel package (is_new_implementation)
    accepts_boundary: bool         # the bound implementation takes boundary_kwarg (else it is dropped)
    why: str = ""                  # why the torch reference: the real exception
    package: str = ""


def because(why: str, package: str) -> str:
    """families.binding.explain_fallback's text, led by what failed."""
    marker = f"but `import {package}` raises "
    if marker in why:
        installed, _, error = why.partition(marker)
        return f"importing {package} failed: {error} ({installed.strip()})"
    return why or "transformers resolved the torch path"


def fallback_fix(call: Call) -> tuple[str, ...]:
    if "raises" in call.why or "does not resolve" in call.why:
        kernel = (f"`{call.package}` is installed but broken (the error above): rebuild the image so its wheel "
                  "matches this torch and CUDA (an undefined symbol is an ABI mismatch)")
    else:
        kernel = f"install the image's `{call.package}` kernel wheel (rebuild the image with `python -m build`)"
    return (kernel, *FIX_UNPACKED)


def locked_kernel_fix(package: str) -> tuple[str, ...]:
    return (f"install the `{package}` version the image locked (rebuild the image with `python -m build`); a kernel "
            "without its own backward, or without the boundary argument, cannot train packed batches",)


def fused_call(call: Call, packed: bool | None, boundary_given: bool,
               allow_fallback: bool) -> tuple[list[Violation], str]:
    """(violations, override) for one training call of a fused function. `packed` None: the batch is
    not known (a call outside the family's model classes), so only the fallback is judged."""
    found: list[Violation] = []
    torch_path = f"{call.function}: torch reference ({call.bound}), because {because(call.why, call.package)}"
    if packed and not boundary_given:
        tail = "" if call.fused else f"; and {call.wrapper} is bound to the torch reference, which would drop it"
        found.append(Violation(call.function, f"packed batch without {call.boundary_kwarg} reached {call.wrapper} "
                               f"({call.kind} layers): its documents leak into each other{tail}", FIX_BOUNDARIES))
        if not call.fused:
            found.append(Violation(call.function, torch_path, fallback_fix(call)))
        return found, ""
    if not call.fused:
        if packed:
            return [Violation(call.function, f"{torch_path}; it drops {call.boundary_kwarg}, so packed documents "
                              "leak into each other", fallback_fix(call))], ""
        if allow_fallback:
            return [], f"{ALLOW_FALLBACK_ENV}=1: {torch_path}; allowed on unpacked batches"
        return [Violation(call.function, torch_path, fallback_fix(call))], ""
    if packed and not call.accepts_boundary:
        return [Violation(call.function, f"{call.function}: {call.bound} takes no {call.boundary_kwarg}; transformers "
                          "drops it, so packed documents leak into each other",
                          locked_kernel_fix(call.package))], ""
    return [], ""


def backward_violation(call: Call, backward: str) -> Violation:
    return Violation(call.function, f"{call.function}: forward ran {call.bound}, but its backward is {backward}, not "
                     "the kernel's autograd Function", locked_kernel_fix(call.package))


@dataclass(frozen=True)
class AttentionCall:
    implementation: str            # config._attn_implementation, e.g. "sdpa"
    wanted: str                    # the family's, e.g. "flash_attention_2"
    function: str                  # module.qualname of the attention function the layer got
    kind: str = "full_attention"


def attention_call(call: AttentionCall, packed: bool | None, boundary_given: bool, separates: bool | None,
                   separation_why: str, allow_fallback: bool) -> tuple[list[Violation], str]:
    """`boundary_given`: cu_seq_lens_q reached the attention (or packed position_ids with no mask, from
    which transformers derives them for flash-attn). `separates`: for a torch attention on a packed
    batch, whether its mask keeps each document to itself (None: unreadable)."""
    impl, kind = call.implementation, call.kind
    if impl == call.wanted:
        if packed and not boundary_given:
            return [Violation("attention", f"packed batch without cu_seq_lens_q reached {kind} ({impl}): flash-attn "
                              "attends across its documents", FIX_BOUNDARIES)], ""
        return [], ""
    torch_path = f"{kind}: {impl} ({call.function}), the torch path, runs instead of {call.wanted}"
    if packed:
        if not separates:
            return [Violation("attention", f"{kind}: {impl} attends across packed documents ({separation_why})",
                              FIX_ATTENTION)], ""
        if allow_fallback:
            return [], f"{ALLOW_FALLBACK_ENV}=1: {torch_path}; allowed, its mask keeps the packed documents apart"
        return [Violation("attention", torch_path, FIX_ATTENTION)], ""
    if allow_fallback:
        return [], f"{ALLOW_FALLBACK_ENV}=1: {torch_path}; allowed on unpacked batches"
    return [Violation("attention", torch_path, FIX_ATTENTION + FIX_UNPACKED)], ""


def attention_backward_violation(call: AttentionCall, backward: str) -> Violation:
    return Violation("attention", f"{call.kind}: {call.implementation} is configured but {call.function} ran "
                     f"{backward}, not a kernel's autograd Function", locked_kernel_fix("flash_attn"))


def eval_warning(function: str, kwarg: str, where: str) -> str:
    return (f"a packed batch without {kwarg} reached {where} outside training (eval or no_grad): not refused, "
            "but its documents leak into each other")
