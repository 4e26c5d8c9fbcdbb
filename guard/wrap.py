"""Where the guard attaches, once the family's modeling module has executed:

  * each fused function the family names (`layer_kinds.*.fused[].wrapper`, e.g. causal_conv1d_fn,
    torch_chunk_gated_delta_rule): the module attribute the layer calls at run time is replaced by
    a wrapper around transformers' own wrapper, so it sees the kwargs the layer passed (before
    transformers drops those the bound implementation does not take) and what transformers bound
    (families.binding reads the closure);
  * the attention: Qwen3.5's attention layer calls
    `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)` on
    every forward (transformers 5.18 modeling_qwen3_5.Qwen3_5Attention.forward), so that instance's
    get_interface is shadowed and hands out a wrapped function: sdpa, eager, flash_attention_2 and
    anything registered later alike;
  * the forward of every model class of the module built on the family's config class (for
    Qwen3.5 text: Qwen3_5TextModel and Qwen3_5ForCausalLM). TRL 1.16's fused LM head calls the
    backbone (Qwen3_5TextModel) directly, bypassing the causal LM's forward, so both are needed;
    the outermost one reads the batch;
  * the forward of each layer kind's token-mixer class (`layer_kinds.*.layer_class`: for Qwen3.5
    text Qwen3_5GatedDeltaNet and Qwen3_5Attention), so the guard sees the layer kind run even
    when the names above are rebound and never called.

Each replaced name is registered as a Binding, so every training forward can tell whether it is
still the guard's and, if not, what it is bound to now.

Every wrapper sets __wrapped__ and checks one flag first; when the window ends, the patches are
undone as well, so later steps call transformers directly. While dynamo traces a wrapper
(torch.compiler.is_compiling()), the wrapper calls compile_watch.compiled_call, which dynamo leaves to run
eagerly, every time the compiled code runs: the guard refuses to vouch for compiled training
forwards (FTIMAGE_GUARD_ALLOW_COMPILE=1 lets them run, logged).
"""
from __future__ import annotations

import functools
import inspect

import torch
from transformers.modeling_utils import PreTrainedModel

from families import ATTENTION_PATH, Family
from families.binding import describe, explain_fallback, read_resolution, transformers_symbol
from guard import rules
from guard.compile_watch import compiled_call
from guard.experts_watch import ExpertsWatch
from guard.layer_watch import Binding, LayerRecord
from guard.state import FunctionRecord, Guard


def _name(obj) -> str:
    """module.qualname of the object itself (describe() unwraps to the innermost)."""
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', None) or type(obj).__qualname__}"


def _reaches(func, target, limit: int = 8) -> bool:
    for _ in range(limit):
        if func is target:
            return True
        func = getattr(func, "__wrapped__", None)
        if func is None:
            return False
    return False


def bound_now(current, ours, transformers_own=None, torch_function=None) -> str:
    """'' while `current` is the guard's wrapper, else what the name is bound to now."""
    if current is ours:
        return ""
    if current is None:
        return "nothing (the name was deleted)"
    if torch_function is not None and current is torch_function:
        return f"{describe(current)} (transformers' torch reference itself, unwrapped)"
    if transformers_own is not None and current is transformers_own:
        return f"{describe(current)} (transformers' own, without the guard's wrapper)"
    outer, inner = _name(current), describe(current)
    if _reaches(current, ours):
        return f"{outer} (a wrapper around the guard's)"
    return outer if outer == inner else f"{outer} (wrapping {inner})"


def model_classes(module, family: Family) -> list[type]:
    config_cls = getattr(module, family.config_class, None)
    found = [c for c in vars(module).values()
             if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == module.__name__
             and "forward" in c.__dict__ and config_cls is not None and getattr(c, "config_class", None) is config_cls]
    causal = getattr(module, family.causal_lm_class, None)
    if causal is not None and causal not in found and "forward" in causal.__dict__:
        found.append(causal)
    return found


def _wrap_forward(guard: Guard, cls: type) -> None:
    original = cls.__dict__["forward"]
    signature = inspect.signature(original)
    name = cls.__name__

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not guard.active:
            return original(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            compiled_call(guard, "model", name, self, True)
            out = original(self, *args, **kwargs)
            compiled_call(guard, "model", name, self, False)
            return out
        return guard.model_forward(original, signature, self, args, kwargs)

    cls.forward = forward

    def undo():
        if cls.__dict__.get("forward") is forward:
            cls.forward = original
    guard.restore.append(undo)


def _wrap_fused(guard: Guard, module, kind: str, fused) -> None:
    rec = FunctionRecord(function=fused.function, kind=kind, wrapper=fused.wrapper, boundary_kwarg=fused.boundary_kwarg)
    guard.records[fused.function] = rec
    res = read_resolution(module, fused.wrapper)
    if not res.readable:
        rec.why = res.error
        guard.setup_problems.append(rules.Violation(
            fused.function, f"{fused.function}: cannot tell what transformers bound: {res.error}",
            ("use the transformers version the image locked",)))
        return
    rec.bound, rec.fused = describe(res.implementation), res.is_new
    if not res.is_new:
        symbol, distribution = transformers_symbol(res)
        rec.why = explain_fallback(res.package, symbol, distribution)
    call = rules.Call(function=fused.function, wrapper=fused.wrapper, kind=kind, boundary_kwarg=fused.boundary_kwarg,
                      bound=rec.bound, fused=res.is_new, accepts_boundary=fused.boundary_kwarg in res.applicable_params,
                      why=rec.why, package=res.package)
    original = getattr(module, fused.wrapper)
    function = fused.function

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if not guard.active:
            return original(*args, **kwargs)
        if torch.compiler.is_compiling():
            compiled_call(guard, "function", function)
            return original(*args, **kwargs)
        return guard.fused(rec, call, original, args, kwargs)

    setattr(module, fused.wrapper, guarded)
    guard.bindings.append(Binding(fused.wrapper, kind, lambda: bound_now(
        getattr(module, fused.wrapper, None), guarded, original, res.torch_function)))

    def undo():
        if getattr(module, fused.wrapper, None) is guarded:
            setattr(module, fused.wrapper, original)
    guard.restore.append(undo)


def _wrap_attention(guard: Guard, module, family: Family) -> None:
    interface = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
    kind = next((name for name, k in family.layer_kinds.items() if (ATTENTION_PATH,) in k.complete_paths()),
                "full_attention")
    rec = FunctionRecord(function="attention", kind=kind, wrapper="ALL_ATTENTION_FUNCTIONS.get_interface",
                         boundary_kwarg="cu_seq_lens_q")
    guard.records["attention"] = rec
    if interface is None or not hasattr(interface, "get_interface"):
        guard.setup_problems.append(rules.Violation(
            "attention", f"{module.__name__} has no ALL_ATTENTION_FUNCTIONS.get_interface: transformers changed how "
            "attention layers pick their implementation", ("use the transformers version the image locked",)))
        return
    plain = interface.get_interface
    handed: dict[tuple[str, int], tuple] = {}

    def wrapped(implementation: str, fn):
        key = (implementation, id(fn))
        if key not in handed:
            @functools.wraps(fn)
            def attention(*args, **kwargs):
                if not guard.active:
                    return fn(*args, **kwargs)
                if torch.compiler.is_compiling():
                    compiled_call(guard, "attention", "attention", args[0] if args else None)
                    return fn(*args, **kwargs)
                return guard.attention(rec, implementation, fn, args, kwargs)
            handed[key] = (fn, attention)      # keeps fn alive, so its id is not reused
        return handed[key][1]

    def get_interface(attn_implementation, default):
        fn = plain(attn_implementation, default)
        if not guard.active:
            return fn
        if not torch.compiler.is_compiling():     # under dynamo, fn is its stand-in: nothing to read there
            rec.bound = f"{attn_implementation}: {describe(fn)}"
            rec.fused = attn_implementation == family.attention.implementation
        return wrapped(attn_implementation, fn)

    interface.get_interface = get_interface

    def now() -> str:
        current = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
        if current is not interface:
            return f"{_name(current)} (ALL_ATTENTION_FUNCTIONS itself was replaced)"
        mine = interface.__dict__.get("get_interface")
        if mine is None:
            return f"{_name(type(interface).get_interface)} (transformers' own, without the guard's wrapper)"
        return bound_now(mine, get_interface)
    guard.bindings.append(Binding("ALL_ATTENTION_FUNCTIONS.get_interface", kind, now))

    def undo():
        if interface.__dict__.get("get_interface") is get_interface:
            del interface.__dict__["get_interface"]
    guard.restore.append(undo)


def _wrap_layer(guard: Guard, module, kind: str, layer_class: str, paths) -> None:
    """The layer kind's token mixer: its forward runs once per layer of the kind and call."""
    rec = LayerRecord(kind=kind, layer_class=layer_class, paths=paths)
    guard.layers[kind] = rec
    cls = getattr(module, layer_class, None)
    if not isinstance(cls, type) or "forward" not in cls.__dict__:
        guard.setup_problems.append(rules.Violation(
            kind, f"{module.__name__} has no class {layer_class} with a forward (families: layer_kinds.{kind}."
            "layer_class): the guard cannot see that layer kind run",
            ("use the transformers version the image locked, or correct layer_class in the family file",)))
        return
    original = cls.__dict__["forward"]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not guard.active:
            return original(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            compiled_call(guard, "layer", kind, self)
            return original(self, *args, **kwargs)
        return guard.layer_forward(kind, original, self, args, kwargs)

    cls.forward = forward
    guard.layer_classes[kind] = cls
    guard.bindings.append(Binding(f"{layer_class}.forward", kind,
                                  lambda: bound_now(cls.__dict__.get("forward"), forward, original)))

    def undo():
        if cls.__dict__.get("forward") is forward:
            cls.forward = original
    guard.restore.append(undo)


def install(guard: Guard, module, family: Family) -> None:
    for cls in model_classes(module, family):
        _wrap_forward(guard, cls)
    if not any(True for _ in model_classes(module, family)):
        guard.setup_problems.append(rules.Violation(
            "model", f"{module.__name__} has no model class on {family.config_class} with a forward: the guard "
            "cannot see batches", ("use the transformers version the image locked",)))
    for kind, layer_kind in family.layer_kinds.items():
        _wrap_layer(guard, module, kind, layer_kind.layer_class, layer_kind.complete_paths())
        for fused in layer_kind.fused:
            _wrap_fused(guard, module, kind, fused)
    _wrap_attention(guard, module, family)
    if family.experts is not None:
        guard.experts = ExpertsWatch(family.name, family.experts, module)
        guard.setup_problems.extend(guard.experts.install())
        guard.restore.append(guard.experts.uninstall)
