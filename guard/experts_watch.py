"""The MoE experts of a training step: which implementation each experts call ran, forward and
backward, and a violation when a per-expert fallback ran in training.

transformers 5.18 (integrations/moe.py) runs a MoE layer's experts through
`ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation, <the class's own forward>)`
on every call, and falls back twice without a word: to `eager` (a Python loop, one matmul per
expert) at load when `_grouped_mm_can_dispatch()` raises, and, inside grouped_mm, to the op
`torch.ops.transformers.grouped_mm_fallback` (one torch.mm per expert) whenever
`_can_use_grouped_mm` says no. Training still runs, many times slower. So, as guard.wrap does for
the attention, the watch shadows that interface instance's `get_interface` and wraps what it hands
out (eager, grouped_mm, batched_mm, anything registered later), and wraps the module attribute
`_can_use_grouped_mm`, which `_grouped_mm` looks up at each call, to see its answer and say why.
Backward: pre-hooks on the nodes each training call put in the graph, as guard.graph does.

Wiring (guard/wrap.py and guard/state.py hold the guard; this module edits neither). With
`family.experts` set:
  at install (wrap.install, once the modeling module has executed):
      guard.experts = ExpertsWatch(family.name, family.experts, module)
      guard.setup_problems.extend(guard.experts.install())
      guard.restore.append(guard.experts.uninstall)      # stop_checking undoes it with the rest
  at each training step (state.Guard.model_forward, where a returned training forward is judged):
      found, override = guard.experts.judge(self.settings.allow_fallback)
      self.note_override(None, override)
      self.violate([found] if found is not None else [])
  in the report (record.build, at the window's end and at exit): data["experts"] = guard.experts.to_dict()
Compiled experts calls are not counted: guard.compile_watch refuses compiled training forwards.
"""
from __future__ import annotations

import functools
import threading
from collections import Counter, deque

import torch

from families import Experts
from families.grouped_mm import FALLBACK, LOAD_FIX, builtin_node_kind, why_not_grouped
from families.grouped_mm import moe_module as _moe
from guard import graph, rules
from guard.settings import ALLOW_FALLBACK_ENV


def backward_kind(node) -> str | None:
    """The experts implementation a backward node belongs to (None: elementwise, indexing...)."""
    if (kind := builtin_node_kind(node)) is not None:
        return kind
    cls = graph.function_class(node)
    return f"{cls.__module__}.{cls.__qualname__}" if cls is not None and graph.is_kernel_function(cls) else None


class ExpertsWatch:
    """Counts, per kind, the experts calls of one family's experts class while installed."""

    def __init__(self, family_name: str, experts: Experts, module):
        self.family_name, self.layer_class, self.wanted = family_name, experts.layer_class, experts.implementation
        self.module = module
        self.active = False
        self.training: Counter = Counter()      # kind -> training forwards of an experts layer
        self.eval: Counter = Counter()
        self.backward: Counter = Counter()      # kind -> training calls whose backward ran it
        self.configured: set[str] = set()       # config._experts_implementation seen in training calls
        self.reasons: dict[str, str] = {}       # why _can_use_grouped_mm said no -> its fix
        self.local = threading.local()          # the experts call in progress on this thread
        self._undo: list = []

    # -- install / uninstall ------------------------------------------------------------------------------
    def install(self) -> list[rules.Violation]:
        """Attach; the problems that keep it from seeing the experts (empty when attached)."""
        cls = getattr(self.module, self.layer_class, None)
        interface = getattr(_moe(), "ALL_EXPERTS_FUNCTIONS", None)
        if not isinstance(cls, type) or interface is None or not hasattr(interface, "get_interface"):
            return [rules.Violation("experts", f"{self.module.__name__} has no {self.layer_class}, or transformers "
                                    "has no ALL_EXPERTS_FUNCTIONS.get_interface: the guard cannot see the experts run",
                                    ("use the transformers version the image locked, or correct experts.layer_class "
                                     f"in families/{self.family_name}.yaml",))]
        self.active = True
        self._shadow_interface(interface, cls)
        self._wrap_can_use()
        return []

    def uninstall(self) -> None:
        self.active = False
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _shadow_interface(self, interface, cls: type) -> None:
        plain, handed = interface.get_interface, {}

        def get_interface(experts_implementation, default):
            fn = plain(experts_implementation, default)
            if not self.active or torch.compiler.is_compiling():
                return fn
            kind = "eager" if fn is default else experts_implementation
            if (kind, id(fn)) not in handed:      # fn kept alive beside its wrapper, so its id is not reused
                handed[(kind, id(fn))] = (fn, self._wrap_experts(kind, fn, cls))
            return handed[(kind, id(fn))][1]

        interface.get_interface = get_interface

        def undo():
            if interface.__dict__.get("get_interface") is get_interface:
                del interface.__dict__["get_interface"]
        self._undo.append(undo)

    def _wrap_can_use(self) -> None:
        moe = _moe()
        original = moe._can_use_grouped_mm

        @functools.wraps(original)
        def can_use(input, weight, offs):
            ok = original(input, weight, offs)
            call = getattr(self.local, "call", None)
            if not ok and self.active and call is not None and not torch.compiler.is_compiling():
                call["fallback"] += 1
                if call["training"]:
                    self._explain(input, weight)
            return ok

        moe._can_use_grouped_mm = can_use

        def undo():
            if moe._can_use_grouped_mm is can_use:
                moe._can_use_grouped_mm = original
        self._undo.append(undo)

    # -- each experts call ----------------------------------------------------------------------------------
    def _wrap_experts(self, kind: str, fn, cls: type):
        @functools.wraps(fn)
        def experts(layer, *args, **kwargs):
            if not self.active or not isinstance(layer, cls) or torch.compiler.is_compiling():
                return fn(layer, *args, **kwargs)
            training = bool(layer.training and torch.is_grad_enabled())
            outer, call = getattr(self.local, "call", None), {"fallback": 0, "training": training}
            self.local.call = call
            try:
                out = fn(layer, *args, **kwargs)
            finally:
                self.local.call = outer
            ran = FALLBACK if call["fallback"] else kind
            if not training:
                self.eval[ran] += 1
                return out
            self.training[ran] += 1
            self.configured.add(str(getattr(layer.config, "_experts_implementation", None)))
            self._watch_backward(out, (args, kwargs))
            return out
        return experts

    def _explain(self, input, weight) -> None:
        reason, fix = why_not_grouped(weight.device, weight.dtype, input, weight)
        if not reason:
            reason = ("transformers' _can_use_grouped_mm said no, yet none of the conditions it tests in transformers "
                      f"5.18 holds here (device {weight.device}, weights {weight.dtype}, torch {torch.__version__})")
            fix = "leave transformers.integrations.moe._can_use_grouped_mm as transformers defines it"
        self.reasons.setdefault(reason, fix)

    def _watch_backward(self, output, inputs) -> None:
        """Pre-hooks on the nodes this call created, from its output back to its inputs' nodes."""
        roots = [t.grad_fn for t in graph.tensors(output) if t.grad_fn is not None]
        stop = {id(t.grad_fn) for t in graph.tensors(inputs) if t.grad_fn is not None}
        queue, seen, ran = deque(roots), set(), set()
        while queue and len(seen) < graph.MAX_NODES:
            node = queue.popleft()
            if node is None or id(node) in seen or id(node) in stop:
                continue
            seen.add(id(node))
            kind = backward_kind(node)
            if kind is not None:
                node.register_prehook(functools.partial(self._backward_ran, ran, kind))
            queue.extend(nxt for nxt, _ in node.next_functions)

    def _backward_ran(self, ran: set, kind: str, grads) -> None:
        if kind not in ran:          # counted once per call, however many of its nodes are of the kind
            ran.add(kind)
            self.backward[kind] += 1

    # -- the verdict ------------------------------------------------------------------------------------------
    def judge(self, allow_fallback: bool = False) -> tuple[rules.Violation | None, str]:
        """(violation, override) for the training calls so far: a per-expert fallback (the eager
        loop or the fallback op) is a violation naming the family, the class and the reason; with
        FTIMAGE_ALLOW_FALLBACK=1 it is an override, logged. The words carry no counts, so a step that
        repeats the same fallback repeats the same violation (guard.state keeps it once)."""
        said, fixes = [], []
        if self.training["eager"]:
            said.append(f"transformers' per-expert eager loop (config experts_implementation: "
                        f"{', '.join(sorted(self.configured))}; transformers picks eager at load, without a word, when "
                        "_grouped_mm_can_dispatch() raises)")
            fixes.append(LOAD_FIX)
        if self.training[FALLBACK]:
            said.append(f"grouped_mm's per-expert fallback op torch.ops.transformers.grouped_mm_fallback, because "
                        f"{'; '.join(self.reasons)}")
            fixes.extend(self.reasons.values())
        if not said:
            return None, ""
        what = (f"experts ({self.layer_class}, family {self.family_name}): a training step ran "
                f"{' and '.join(said)}, not {self.wanted}: one small matmul per expert, forward and backward")
        if allow_fallback:
            return None, f"{ALLOW_FALLBACK_ENV}=1: {what}; allowed, logged"
        return rules.Violation("experts", what, tuple(dict.fromkeys(fixes))), ""

    def violation(self, allow_fallback: bool = False) -> rules.Violation | None:
        return self.judge(allow_fallback)[0]

    def to_dict(self) -> dict:
        return {"layer_class": self.layer_class, "wanted": self.wanted, "configured": sorted(self.configured),
                "training": dict(self.training), "eval": dict(self.eval), "backward": dict(self.backward),
                "reasons": list(self.reasons)}
