"""The guard of one process: its window of training steps, what every guarded call saw, and the
decision at each call (pure rules in guard.rules). The wrappers (guard.wrap) call in here only
while the window is open; after it, they are a flag check and a direct call.

A violation inside a forward of the family's model is held until that forward returns, so the one
error names every layer kind that is wrong; anywhere else (an activation-checkpoint recompute
inside backward, a call from outside the family's model classes) it refuses at once.

The layer kinds (which guarded functions ran inside each layer call, judged when the forward
returns) are guard.layer_watch's half of Guard; compiled code, which never reaches the methods
here, is guard.compile_watch's.
"""
from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from families import ATTENTION_PATH, Family
from families.binding import describe
from guard import batch as batch_mod
from guard import graph, record, rules
from guard.compile_watch import CompileWatch
from guard.layer_watch import Binding, LayerRecord, LayerWatch
from guard.settings import Settings

UNATTRIBUTED_LIMIT = 256   # training calls seen outside the family's model classes before the window closes anyway


@dataclass
class FunctionRecord:
    function: str
    kind: str
    wrapper: str
    boundary_kwarg: str
    bound: str = ""
    fused: bool | None = None
    why: str = ""
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("forward_fused", "forward_torch", "backward_fused", "backward_torch", "recompute", "eval", "compiled"), 0))
    forward_impls: set[str] = field(default_factory=set)
    backward_impls: set[str] = field(default_factory=set)
    packed_calls: int = 0
    boundary_present: int = 0
    boundary_missing: int = 0
    override: str = ""


class Guard(LayerWatch, CompileWatch):
    def __init__(self, settings: Settings, family: Family, module_name: str):
        self.settings, self.family, self.module_name = settings, family, module_name
        self.active = True
        self.pid = os.getpid()
        self.steps = 0                     # training forwards of the family's model begun
        self.records: dict[str, FunctionRecord] = {}
        self.violations: list[rules.Violation] = []
        self.pending: list[rules.Violation] = []
        self.setup_problems: list[rules.Violation] = []
        self.warnings: list[str] = []
        self.overrides: list[str] = []
        self.batches = {"training": 0, "packed": 0, "eval": 0, "documents_max": 0}
        self.kwargs_seen: set[str] = set()
        self.layouts: set[str] = set()
        self.unattributed = 0
        self.restore: list = []            # callables that undo the patches
        self.experts = None                # guard.experts_watch.ExpertsWatch of a MoE family
        self.last_training: batch_mod.Batch | None = None
        self.local = threading.local()     # depth and batch of the family-model forward on this thread
        self.lock = threading.RLock()
        self.window_ended = False
        self.layers: dict[str, LayerRecord] = {}
        self.layer_classes: dict[str, type] = {}     # kind -> its token-mixer class (guard.wrap)
        self.bindings: list[Binding] = []
        self.rebound: dict[str, str] = {}           # every rebinding seen in a training step
        self.compiled_counts = {"training_forwards": 0, "eval_forwards": 0, "training_calls": 0}
        self.compiled_where: list[str] = []         # what was first seen compiled (a few)
        self.compiled_steps = 0                     # training steps of the window that ran compiled
        self.silent = ""                            # why the guard vouches for nothing (compiled, allowed)

    # -- context ------------------------------------------------------------------------------------
    def context(self) -> tuple[batch_mod.Batch | None, bool]:
        """(the batch this call belongs to, whether it is a recompute inside backward)."""
        if getattr(self.local, "depth", 0) > 0:
            return self.local.batch, False
        if graph.in_backward() and self.last_training is not None:
            return self.last_training, True
        return None, False

    def violate(self, found: list[rules.Violation]) -> None:
        for v in found:
            if v not in self.violations:
                self.violations.append(v)
                self.pending.append(v)
        if self.pending and getattr(self.local, "depth", 0) == 0:
            self.refuse()

    def note_override(self, rec: FunctionRecord | LayerRecord | None, override: str) -> None:
        if override and override not in self.overrides:
            self.overrides.append(override)
            if rec is not None:
                rec.override = override
            record.log(f"override: {override}")

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            record.log(f"warning: {message}")

    # -- the family model's forward ----------------------------------------------------------------------
    def model_forward(self, original, signature, model, args, kwargs):
        if getattr(self.local, "depth", 0) > 0:
            return original(model, *args, **kwargs)
        training = bool(model.training and torch.is_grad_enabled())
        if training:
            self.steps += 1
            if self.steps > self.settings.steps:
                self.close_window()
                return original(model, *args, **kwargs)
            if self.setup_problems:
                self.violate(self.setup_problems)
        try:
            bound = signature.bind_partial(model, *args, **kwargs).arguments
            arguments = {**bound, **bound.pop("kwargs", {})}
        except TypeError:
            arguments = dict(kwargs)
        batch = batch_mod.inspect_batch(arguments, training)
        self._count_batch(batch)
        present = self._present(model) if training else Counter()
        rebound = self.rebound_now() if training else {}
        self.local.depth, self.local.batch = 1, batch
        self.local.tally, self.local.compiled_layers = {}, Counter()
        returned = False
        try:
            out = original(model, *args, **kwargs)
            returned = True
            return out
        finally:
            tally, compiled_layers = self.local.tally, self.local.compiled_layers
            self.local.depth, self.local.batch, self.local.tally = 0, None, None
            if training:
                self.last_training = batch
                # only a forward that returned hands on what its layers computed
                if returned and self.active:
                    self.violate(self._judge_layers(model, batch, tally, compiled_layers, present, rebound))
                    if self.experts is not None:
                        found, override = self.experts.judge(self.settings.allow_fallback)
                        self.note_override(None, override)
                        self.violate([found] if found is not None else [])
            if self.pending:
                self.refuse()

    def _count_batch(self, batch: batch_mod.Batch) -> None:
        self.batches["training" if batch.training else "eval"] += 1
        if batch.packed:
            self.batches["packed"] += 1
            self.batches["documents_max"] = max(self.batches["documents_max"], batch.documents)
        if batch.training:
            self.kwargs_seen.update(batch.kwargs_seen)
            self.layouts.add(batch.layout)
        for note in batch.notes:
            self.warn(note)

    def _training_context(self, rec: FunctionRecord):
        """(batch, recompute, training) for a guarded call; counts eval calls."""
        batch, recompute = self.context()
        training = batch.training if batch is not None else torch.is_grad_enabled()
        if not training:
            rec.calls["eval"] += 1
        elif batch is None:
            self.unattributed += 1
            if self.unattributed > UNATTRIBUTED_LIMIT:
                self.warn(f"{self.unattributed} training calls came from outside the family's model classes "
                          f"({self.family.causal_lm_class}, ...): the window closed without counting steps")
                self.close_window()
        return batch, recompute, training

    # -- a fused function (causal_conv1d_fn, chunk_gated_delta_rule) ---------------------------------------
    def fused(self, rec: FunctionRecord, call: rules.Call, original, args, kwargs):
        self._mark(call.function)
        batch, recompute, training = self._training_context(rec)
        given = kwargs.get(call.boundary_kwarg) is not None
        if not training or not self.active:
            if batch is not None and batch.packed and not given:
                self.warn(rules.eval_warning(call.function, call.boundary_kwarg, call.wrapper))
            return original(*args, **kwargs)
        packed = batch.packed if batch is not None else None
        if packed and not recompute:
            rec.packed_calls += 1
            rec.boundary_present += given
            rec.boundary_missing += not given
        found, override = rules.fused_call(call, packed, given, self.settings.allow_fallback)
        self.note_override(rec, override)
        self.violate(found)
        out = original(*args, **kwargs)
        rec.calls["recompute" if recompute else "forward_fused" if call.fused else "forward_torch"] += 1
        rec.forward_impls.add(call.bound)
        self._count_backward(rec, out, args, kwargs, call.fused,
                             lambda described: rules.backward_violation(call, described))
        return out

    # -- the attention function a full-attention layer got from ALL_ATTENTION_FUNCTIONS -------------------
    def attention(self, rec: FunctionRecord, implementation: str, fn, args, kwargs):
        self._mark(ATTENTION_PATH)
        batch, recompute, training = self._training_context(rec)
        mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
        wanted = self.family.attention.implementation
        given = kwargs.get("cu_seq_lens_q") is not None or (
            mask is None and batch is not None and batch.position_packed and kwargs.get("position_ids") is not None)
        if not training or not self.active:
            if batch is not None and batch.packed and implementation == wanted and not given:
                self.warn(rules.eval_warning("attention", "cu_seq_lens_q", f"full_attention ({implementation})"))
            return fn(*args, **kwargs)
        packed = batch.packed if batch is not None else None
        call = rules.AttentionCall(implementation=implementation, wanted=wanted, function=describe(fn))
        separates, why = None, ""
        if packed and implementation != wanted:
            separates, why = self._separates(batch, mask)
        if packed and not recompute:     # did the boundaries arrive (whether the torch path honours them is
            rec.packed_calls += 1        # the verdict's business)
            rec.boundary_present += given
            rec.boundary_missing += not given
        found, override = rules.attention_call(call, packed, given, separates, why, self.settings.allow_fallback)
        self.note_override(rec, override)
        self.violate(found)
        out = fn(*args, **kwargs)
        fused = implementation == wanted
        rec.calls["recompute" if recompute else "forward_fused" if fused else "forward_torch"] += 1
        rec.forward_impls.add(f"{implementation}: {call.function}")
        self._count_backward(rec, out, args, kwargs, fused,
                             lambda described: rules.attention_backward_violation(call, described))
        return out

    def _count_backward(self, rec: FunctionRecord, out, args, kwargs, fused: bool, violation) -> None:
        """Which backward this call recorded (the kernel's autograd Function or aten ops), counted
        when it runs; a fused forward whose backward is torch's is a violation."""
        if not torch.is_grad_enabled():
            return
        backward = graph.inspect_call(out, (args, kwargs))
        if backward.root is None:
            return
        if fused and backward.kernel is None:
            self.violate([violation(backward.describe)])
        node, key = ((backward.kernel, "backward_fused") if backward.kernel is not None
                     else (backward.root, "backward_torch"))
        graph.count_backward(node, rec.calls, key)
        rec.backward_impls.add(backward.describe if backward.kernel is not None
                               else f"torch autograd ops ({backward.root_name})")

    @staticmethod
    def _separates(batch: batch_mod.Batch, mask) -> tuple[bool | None, str]:
        cache = batch.__dict__.setdefault("_mask_cache", {})
        key = id(mask)
        if key not in cache:
            cache[key] = (mask, batch_mod.mask_separates(mask, batch.docs))
        return cache[key][1]

    # -- the end -----------------------------------------------------------------------------------------
    def stop_checking(self) -> None:
        self.active = False
        for undo in reversed(self.restore):
            undo()
        self.restore.clear()

    def close_window(self) -> None:
        with self.lock:
            if not self.active:
                return
            self.stop_checking()
            self.window_ended = True
            data = record.build(self)
            record.publish(self, data)
            record.log(record.summary(self, data))

    def refuse(self) -> None:
        with self.lock:
            self.stop_checking()
            record.refuse(self)

    def saw_anything(self) -> bool:
        return bool(self.batches["training"] or self.batches["eval"] or any(self.compiled_counts.values())
                    or any(sum(r.calls.values()) for r in self.records.values())
                    or any(r.runs or r.recompute or r.outside or r.compiled or r.eval for r in self.layers.values()))

    def at_exit(self) -> None:
        """The report of a process whose window never ended: what it saw, compiled forwards included."""
        if os.getpid() != self.pid or not self.active or not self.saw_anything():
            return
        with self.lock:
            self.active = False
            record.publish(self, record.build(self))

