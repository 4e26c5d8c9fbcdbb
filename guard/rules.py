"""The guard's decisions, as pure functions: one call of a fused function or of the attention in a
training step, against the batch it belongs to; the runs of a layer kind, against its complete
fused paths; a training forward under torch.compile. Each gives what is wrong (a Violation: the
layer kind and what ran or what was missing, with the fix for common trainers) or what an
override let through. No torch here: the wrappers gather the facts."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from families import ATTENTION_PATH
from guard.settings import ALLOW_COMPILE_ENV, ALLOW_FALLBACK_ENV

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
    function: str      # "causal_conv1d_fn", "chunk_gated_delta_rule", "attention"; a layer kind; "torch.compile"
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


# -- a layer kind: did one of its complete fused paths run? -----------------------------------------------
Path = tuple[str, ...]


def path_label(path: Path) -> str:
    if tuple(path) == (ATTENTION_PATH,):
        return "the attention function from ALL_ATTENTION_FUNCTIONS.get_interface"
    return " + ".join(path)


def complete_path(functions_ran: Iterable[str], paths: Iterable[Path]) -> Path | None:
    """The first path every function of which ran, or None."""
    ran = set(functions_ran)
    return next((tuple(p) for p in paths if p and set(p) <= ran), None)


def layer_kind_call(kind: str, layer_class: str, runs: int, functions_ran: frozenset[str], paths: tuple[Path, ...],
                    rebound: Mapping[str, str], packed: bool | None = True,
                    allow_fallback: bool = False) -> tuple[Violation | None, str]:
    """(violation, override) for `runs` calls of a layer kind's forward in a training step, each of
    which ran exactly the guarded functions `functions_ran`. A layer passes only when every function
    of one of its complete `paths` ran inside it: a layer that ran while its functions did not ran
    something the guard never saw. `rebound`: the kind's names (modeling-module attributes,
    get_interface) that are no longer the guard's, each with what it is bound to now.
    FTIMAGE_ALLOW_FALLBACK lets transformers' own code run without the path on a batch known to be
    unpacked (`packed` False), never a rebound name."""
    if runs <= 0 or complete_path(functions_ran, paths) is not None:
        return None, ""
    wanted = " or ".join(path_label(p) for p in paths)
    partial = sorted(set(functions_ran) & {f for p in paths for f in p})
    what = f"{kind} ({layer_class}) ran {runs} time(s) without a complete fused path ({wanted})"
    if partial:
        what += f": only {', '.join(partial)} ran"
    if rebound:
        what += f"; rebound after the guard attached at import: {rebound_text(rebound)}"
        return Violation(kind, what, fix_rebound(sorted(rebound))), ""
    if not partial:
        what += "; the layer called none of the functions the guard checks"
    if packed is False and allow_fallback:
        return None, f"{ALLOW_FALLBACK_ENV}=1: {what}; allowed on unpacked batches"
    return Violation(kind, what, (f"run {kind} with the image's kernels: install its kernel wheels (rebuild the "
                                  "image with `python -m build`) and keep transformers' modeling code as it is",
                                  *FIX_UNPACKED)), ""


def rebound_text(rebound: Mapping[str, str]) -> str:
    return "; ".join(f"{name} is now {now}" for name, now in sorted(rebound.items()))


def fix_rebound(names: Iterable[str]) -> tuple[str, ...]:
    return (f"leave {', '.join(names)} as transformers bound them at import (the guard checks the kernels "
            "through them): remove the code that rebinds them; a broken kernel is fixed by rebuilding the image "
            "(`python -m build`), not by swapping in the torch reference",)


def layers_unseen(kind: str, layer_class: str, present: int, seen: int,
                  bypass: tuple[str, ...]) -> Violation | None:
    """The model holds `present` layers of a kind, but only `seen` ran through the forward the guard
    wrapped: the rest ran something it never saw (the class's forward rebound, an instance's own)."""
    if seen >= present:
        return None
    ran = "none" if seen == 0 else f"only {seen}"
    what = (f"{kind}: the model holds {present} {layer_class} layer(s), but {ran} ran through "
            f"{layer_class}.forward in this training step")
    what += f"; what ran instead: {'; '.join(bypass)}" if bypass else "; the others ran code the guard does not see"
    return Violation(kind, what, (f"leave {layer_class}.forward as transformers defines it (the guard checks the layer "
                                  "kind there): remove the code that replaces it on the class or on its instances",))


# -- torch.compile ------------------------------------------------------------------------------------------
def fix_compile(steps: int) -> tuple[str, ...]:
    return (f"run the first {steps} training step(s) eagerly: drop `torch.compile(model)` (transformers and TRL: "
            "`torch_compile=False`), or compile only after them (the guard lets go when its window ends)",
            f"or set {ALLOW_COMPILE_ENV}=1 to train compiled forwards with no runtime check (logged, recorded in the "
            "report)")


def compiled_call(where: str, steps: int, allow_compile: bool) -> tuple[Violation | None, str]:
    """(violation, override) for a training call the guard saw only from inside code that dynamo
    traced: compiled code runs without the guard's wrappers, so it can vouch for nothing there."""
    if allow_compile:
        return None, (f"{ALLOW_COMPILE_ENV}=1: {where} runs under torch.compile; the guard does not check compiled "
                      "code, so it is silent about the fused kernels and packed-batch boundaries of these forwards")
    return Violation("torch.compile", f"{where} ran under torch.compile in a training step: dynamo traces through the "
                     "guard's wrappers, so it cannot check the fused kernels or the packed-batch boundaries of "
                     "compiled code, and will not vouch for it", fix_compile(steps)), ""
