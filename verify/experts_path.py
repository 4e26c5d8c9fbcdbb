"""Which MoE experts implementation really ran, forward and backward, and why not the grouped one.

transformers 5.18 picks a MoE layer's experts implementation twice, silently both times:
  * at load, `get_correct_experts_implementation` takes `eager` (a Python loop, one matmul per
    expert) when `_grouped_mm_can_dispatch()` raises and no implementation was requested;
  * at run time, `integrations.moe._grouped_mm` calls the per-expert fallback op
    `torch.ops.transformers.grouped_mm_fallback` whenever `_can_use_grouped_mm` says no, and that
    says only "no", never why.
Either way training runs, with no error, at a fraction of the speed. So one packed forward and
backward is watched as it runs (nothing of the model is changed):
  * forward: sys.setprofile sees which experts function each call of the family's experts class
    entered (the eager loop, each registered implementation) and whether `_grouped_mm` went to the
    fallback op, with the reason derived from the conditions `_can_use_grouped_mm` tests;
  * backward: pre-hooks on the nodes each experts call put in the graph (no further than its
    inputs) say which ran: GroupedMmBackward0, the fallback op's generated backward, bmm, mm.
`decide_experts` turns that into the row `experts.<family>`.
"""
from __future__ import annotations

import sys
from collections import Counter, deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from families.binding import describe
from families.grouped_mm import FALLBACK, LOAD_FIX, PER_EXPERT, builtin_node_kind, device_type, why_not_grouped
from families.grouped_mm import fallback_reason as fallback_reason  # re-exported: the row's callers use it
from families.grouped_mm import moe_module as _moe
from verify.calltrace import innermost_code
from verify.probe import packed_batch, token_loss_sum
from verify.report import CheckResult, Status

ALLOW_FALLBACK_ENV = "FTIMAGE_ALLOW_FALLBACK"
MAX_NODES = 5_000                        # an eager experts call leaves ~10 nodes per expert


def _unexplained(device, dtype) -> tuple[str, str]:
    """The fallback ran though none of the conditions holds: the function is not transformers' own,
    or its conditions changed."""
    moe = _moe()
    now = moe._can_use_grouped_mm
    own = getattr(getattr(now, "__code__", None), "co_filename", "") == moe.__file__
    what = ("transformers' own, so its conditions changed: re-read integrations/moe.py" if own
            else f"now {describe(now)}, not transformers' own")
    return (f"transformers' _can_use_grouped_mm said no, yet none of the conditions it tests in transformers 5.18 "
            f"holds here (device {device}, weights {dtype}, torch {torch.__version__}); it is {what}",
            "leave transformers.integrations.moe._can_use_grouped_mm as transformers defines it" if not own
            else "update families/grouped_mm.py why_not_grouped to the installed transformers")


# -- one watched step -----------------------------------------------------------------------------------------
@dataclass
class _Call:
    kind: str                                   # the implementation entered: "eager", "grouped_mm", ...
    frame: object
    inputs: list
    fallback: int = 0                           # _grouped_mm calls that went to the fallback op
    backward: set[str] = field(default_factory=set)

    @property
    def ran(self) -> str:
        return FALLBACK if self.fallback else self.kind


@dataclass
class ExpertsRun:
    """What one packed forward and backward ran in the experts layers."""

    experts_class: str
    wanted: str
    device: str
    modules: int = 0                            # experts layers of that class in the model
    configured: tuple[str, ...] = ()            # their config._experts_implementation values
    forward: dict[str, int] = field(default_factory=dict)     # kind -> experts calls
    backward: dict[str, int] = field(default_factory=dict)    # kind -> experts calls whose backward ran it
    reasons: tuple[str, ...] = ()               # why _grouped_mm took the fallback op
    fixes: tuple[str, ...] = ()
    load_reason: str = ""                       # why eager is configured
    error: str = ""                             # the step could not run

    def to_dict(self) -> dict:
        return asdict(self)


class _Recorder:
    """The sys.setprofile function: which implementation each experts call entered, and what it returned."""

    def __init__(self, experts_cls: type, implementations: dict):
        self.cls, self.implementations = experts_cls, implementations
        self.fallback_code = innermost_code(_moe()._grouped_mm_fallback)   # what the fallback op runs
        self.stack: list[_Call] = []
        self.calls: list[tuple[_Call, object]] = []
        self.reasons: dict[str, str] = {}

    def __call__(self, frame, event, arg):
        if event == "call":
            kind = self.implementations.get(frame.f_code)
            if kind is not None and isinstance(frame.f_locals.get("self"), self.cls):
                inputs = [v for k, v in frame.f_locals.items() if k != "self" and torch.is_tensor(v)]
                self.stack.append(_Call(kind, frame, inputs))
            elif frame.f_code is self.fallback_code and self.stack:
                self.stack[-1].fallback += 1
                self._explain(frame.f_locals.get("input"), frame.f_locals.get("weight"))
        elif event == "return" and self.stack and frame is self.stack[-1].frame:
            call = self.stack.pop()
            call.frame = None
            self.calls.append((call, arg))

    def _explain(self, input, weight) -> None:
        if weight is None:
            return
        # the op gets input already cast to weight's dtype; the alignment transformers saw is weight's
        reason, fix = why_not_grouped(weight.device, weight.dtype, *(t for t in (input, weight) if t is not None))
        if not reason:
            reason, fix = _unexplained(weight.device, weight.dtype)
        self.reasons.setdefault(reason, fix)


def _implementations(experts_cls: type) -> dict:
    """code object -> kind: the class's own forward (the eager loop) and every registered one."""
    moe = _moe()
    codes = {innermost_code(experts_cls.forward): "eager"}
    for name in moe.ALL_EXPERTS_FUNCTIONS:
        codes.setdefault(innermost_code(moe.ALL_EXPERTS_FUNCTIONS[name]), name)
    codes.pop(None, None)
    return codes


def node_kind(node) -> str | None:
    """Which experts implementation a backward node belongs to (None: elementwise, indexing...)."""
    if (kind := builtin_node_kind(node)) is not None:
        return kind
    cls = getattr(node, "_forward_cls", None)
    module = getattr(cls, "__module__", "") or ""
    if cls is not None and module.split(".")[0] not in ("torch", "transformers"):
        return f"{module}.{cls.__qualname__}"   # a kernel's own autograd.Function (sonicmoe, deepgemm...)
    return None


def _watch_backward(call: _Call, output) -> None:
    """Pre-hooks on the nodes this call created, from its output back to its inputs' nodes."""
    if not torch.is_tensor(output) or output.grad_fn is None:
        return
    stop = {id(t.grad_fn) for t in call.inputs if t.grad_fn is not None}
    queue, seen = deque([output.grad_fn]), set()
    while queue and len(seen) < MAX_NODES:
        node = queue.popleft()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        kind = node_kind(node)
        if kind is not None:
            node.register_prehook(lambda grads, kind=kind: call.backward.add(kind))
        queue.extend(nxt for nxt, _ in node.next_functions)


@contextmanager
def _profiling(profiler: Callable):
    previous = sys.getprofile()
    sys.setprofile(profiler)
    try:
        yield
    finally:
        sys.setprofile(previous)


def _load_reason(model, configured: tuple[str, ...], wanted: str) -> str:
    if "eager" not in configured or wanted == "eager" or not hasattr(model, "_grouped_mm_can_dispatch"):
        return ""
    try:
        model._grouped_mm_can_dispatch()
    except (ValueError, ImportError) as exc:     # what get_correct_experts_implementation swallows
        return (f"transformers picked eager at load: {type(model).__name__}._grouped_mm_can_dispatch() raises "
                f"{type(exc).__name__}: {exc}, and with no implementation requested "
                "get_correct_experts_implementation takes eager without a word")
    return ("experts_implementation='eager' was requested (from_pretrained(..., experts_implementation='eager') "
            "or set_experts_implementation('eager'))")


def record_experts_path(model, experts_class: str, wanted: str = "grouped_mm", batch: dict | None = None) -> ExpertsRun:
    """One packed forward and backward of `model`, watching every call of its `experts_class`
    layers. Gradients come from torch.autograd.grad, so no parameter's .grad changes; the model is
    run in the mode it is in. `batch`: a contracts.collate row (default: verify's probe documents)."""
    layers = [m for m in model.modules() if type(m).__name__ == experts_class]
    device = next(model.parameters()).device
    run = ExpertsRun(experts_class, wanted, str(device), modules=len(layers))
    if not layers:
        run.error = f"the model holds no {experts_class} layer"
        return run
    run.configured = tuple(sorted({str(getattr(m.config, "_experts_implementation", None)) for m in layers}))
    run.load_reason = _load_reason(model, run.configured, wanted)
    if batch is None:
        batch = packed_batch(model.config.get_text_config().vocab_size, str(device))
    recorder = _Recorder(type(layers[0]), _implementations(type(layers[0])))
    try:
        with _profiling(recorder):
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        loss = token_loss_sum(logits, batch["labels"])
        for call, output in recorder.calls:
            _watch_backward(call, output)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("no parameter requires grad, so there is no backward to watch")
        torch.autograd.grad(loss, params, allow_unused=True)
    except Exception as exc:  # noqa: BLE001 - the row says what failed; work not done is a FAIL
        run.error = f"{type(exc).__name__}: {exc}"
    run.forward = dict(Counter(call.ran for call, _ in recorder.calls))
    run.backward = dict(Counter(kind for call, _ in recorder.calls for kind in call.backward))
    run.reasons, run.fixes = tuple(recorder.reasons), tuple(recorder.reasons.values())
    return run


# -- the row ----------------------------------------------------------------------------------------------------
def _count(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items())) or "nothing"


def _what_ran(run: ExpertsRun) -> tuple[list[str], list[str]]:
    """(what ran instead of the wanted path, the fixes), one entry per kind."""
    said, fixes = [], []
    ran = set(run.forward) | set(run.backward)
    if "eager" in ran:
        why = run.load_reason or f"config experts_implementation is {', '.join(run.configured)}"
        said.append(f"transformers' per-expert eager loop ran ({why})")
        fixes.append(LOAD_FIX)
    if FALLBACK in ran:
        said.append(f"{run.wanted} is configured, but transformers' _grouped_mm took its per-expert fallback op "
                    f"(torch.ops.transformers.grouped_mm_fallback: one torch.mm per expert, forward and backward) "
                    f"because {'; '.join(run.reasons) or 'of a condition no longer visible'}")
        fixes.extend(run.fixes)
    for kind in sorted(ran - {"eager", FALLBACK, run.wanted}):
        said.append(f"{kind} ran, not {run.wanted} (config experts_implementation: {', '.join(run.configured)})")
        fixes.append(f'load the model with experts_implementation="{run.wanted}"')
    return said, list(dict.fromkeys(fixes))


def decide_experts(family_name: str, recorded: ExpertsRun, device, allow_fallback: bool = False) -> CheckResult:
    """The row `experts.<family>`: PASS when the wanted path ran in every experts call forward and
    its backward ran it too; FAIL when anything else ran (the eager loop, the fallback op, another
    implementation), or nothing did, naming why and the fix. `allow_fallback`
    (FTIMAGE_ALLOW_FALLBACK=1) turns a per-expert fallback (eager loop or fallback op) into a WARN
    naming the override on CPU only: on a GPU it stays a FAIL (the gate's own override still lets a
    command run)."""
    check, cls, data = f"experts.{family_name}", recorded.experts_class, recorded.to_dict()
    steps = f"forward: {_count(recorded.forward)}; backward: {_count(recorded.backward)}"
    if recorded.error:
        return CheckResult(check, Status.FAIL, f"{cls}: one packed step could not be watched: {recorded.error}",
                           f"name the installed transformers' experts class in families/{family_name}.yaml "
                           "(experts.layer_class) and keep the model trainable", data)
    if not recorded.forward:
        return CheckResult(check, Status.FAIL, f"no {cls} call ran in a packed forward ({recorded.modules} layers)",
                           f"check experts.layer_class in families/{family_name}.yaml against the modeling code",
                           data)
    said, fixes = _what_ran(recorded)
    others = (set(recorded.forward) | set(recorded.backward)) - {recorded.wanted}
    if not said and set(recorded.backward) == {recorded.wanted}:
        return CheckResult(check, Status.PASS, f"{cls}: {recorded.wanted} ran ({steps})", data=data)
    if not said:
        return CheckResult(check, Status.FAIL, f"{cls}: {recorded.wanted} ran forward, but no {recorded.wanted} "
                           f"backward was seen ({steps})",
                           "keep the experts' weights trainable (requires_grad) so the grouped backward runs", data)
    detail, kind = f"{cls}: {'; '.join(said)} ({steps})", device_type(device)
    per_expert_only = others <= set(PER_EXPERT)
    if kind == "cpu" and (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        detail += f"; torch {torch.__version__} runs grouped_mm on CPU, so nothing on this machine forces it"
    if allow_fallback and per_expert_only and kind == "cpu":
        return CheckResult(check, Status.WARN, f"{ALLOW_FALLBACK_ENV}=1: {detail}; allowed on CPU, logged",
                           " / ".join(fixes), data)
    if allow_fallback and per_expert_only:
        detail += f"; {ALLOW_FALLBACK_ENV}=1 allows the per-expert fallback on CPU only, not on {kind}"
    return CheckResult(check, Status.FAIL, detail, " / ".join(fixes), data)


def experts_row(family, model, device, allow_fallback: bool = False) -> CheckResult | None:
    """`experts.<family>` for a family with experts (families.Family.experts), else None."""
    if family.experts is None:
        return None
    run = record_experts_path(model, family.experts.layer_class, family.experts.implementation)
    return decide_experts(family.name, run, device, allow_fallback)
