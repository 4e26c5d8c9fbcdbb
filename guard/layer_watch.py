"""The guard's view of each layer kind: its token mixer's forward (guard.wrap wraps it) records
which guarded functions ran inside each call, and a layer that ran without one of its complete
fused paths is a violation (guard.rules.layer_kind_call), whatever the names it calls are bound
to now. It also counts the layers of each kind the model holds against the runs it saw, and says
what each name the guard replaced is bound to when it is no longer the guard's.

LayerWatch is part of guard.state.Guard: it uses the guard's thread-local forward context
(`local`), `context()`, `violate()` and `note_override()`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from families.binding import describe
from guard import batch as batch_mod
from guard import rules


@dataclass
class LayerRecord:
    """One layer kind: how often its forward ran in training steps, and which complete path ran."""

    kind: str
    layer_class: str
    paths: tuple[tuple[str, ...], ...]
    runs: int = 0              # inside the family model's training forwards
    recompute: int = 0         # inside backward (activation checkpointing)
    outside: int = 0           # training calls outside the family's model forwards
    compiled: int = 0          # training calls seen only from inside compiled code
    eval: int = 0
    present: int = 0           # the most layers of this kind a model held at a training step
    paths_ran: dict[str, int] = field(default_factory=dict)   # path label, or NO_PATH -> layer calls
    override: str = ""


NO_PATH = "no complete path"


@dataclass(frozen=True)
class Binding:
    """A name the guard replaced (a modeling-module attribute, get_interface, a layer class's
    forward): `now()` is '' while it is still the guard's, else what it is bound to now."""

    name: str
    kind: str
    now: Callable[[], str]


class LayerWatch:
    """The layer-kind half of guard.state.Guard."""

    def _present(self, model) -> Counter:
        """kind -> how many layers of it the model holds (FSDP2's class swap keeps isinstance true)."""
        found: Counter = Counter()
        for module in model.modules():
            for kind, cls in self.layer_classes.items():
                if isinstance(module, cls):
                    found[kind] += 1
        for kind, count in found.items():
            self.layers[kind].present = max(self.layers[kind].present, count)
        return found

    def rebound_now(self, kind: str | None = None) -> dict[str, str]:
        """name -> what it is bound to now, for each name the guard replaced that is no longer its own."""
        found = {}
        for b in self.bindings:
            if kind is None or b.kind == kind:
                now = b.now()
                if now:
                    found[b.name] = now
        self.rebound.update(found)
        return found

    def _mark(self, function: str) -> None:
        """A guarded function ran: credit it to the layer call it ran in, on this thread."""
        frames = getattr(self.local, "frames", None)
        if frames:
            frames[-1].add(function)

    def layer_forward(self, kind: str, original, module, args, kwargs):
        rec = self.layers[kind]
        batch, recompute = self.context()
        training = batch.training if batch is not None else bool(module.training and torch.is_grad_enabled())
        if not training:
            rec.eval += 1
            return original(module, *args, **kwargs)
        frames = getattr(self.local, "frames", None)
        if frames is None:
            frames = self.local.frames = []
        frame: set[str] = set()
        frames.append(frame)
        try:
            out = original(module, *args, **kwargs)
        finally:
            frames.pop()
        # judged only once it returned: an activation-checkpoint recompute may stop early, by raising
        ran = frozenset(frame)
        path = rules.complete_path(ran, rec.paths)
        label = rules.path_label(path) if path else NO_PATH
        rec.paths_ran[label] = rec.paths_ran.get(label, 0) + 1
        tally = getattr(self.local, "tally", None)
        if getattr(self.local, "depth", 0) > 0 and tally is not None:
            rec.runs += 1
            tally.setdefault(kind, Counter())[ran] += 1      # judged when the model's forward returns
            return out
        if recompute:
            rec.recompute += 1
        else:
            rec.outside += 1
        if self.active:
            found, override = rules.layer_kind_call(kind, rec.layer_class, 1, ran, rec.paths, self.rebound_now(kind),
                                                    batch.packed if batch is not None else None,
                                                    self.settings.allow_fallback)
            self.note_override(rec, override)
            self.violate([found] if found else [])
        return out

    def _judge_layers(self, model, batch: batch_mod.Batch, tally: dict, compiled_layers: Counter, present: Counter,
                      rebound: dict[str, str]) -> list[rules.Violation]:
        """At the return of a training forward: each layer kind that ran, against its complete paths;
        and each layer of the model that should have run, against the runs the guard saw."""
        rebound = {**rebound, **self.rebound_now()}
        found: list[rules.Violation] = []
        for kind, rec in self.layers.items():
            mine = {b.name: rebound[b.name] for b in self.bindings if b.kind == kind and b.name in rebound}
            for ran, runs in sorted((tally or {}).get(kind, {}).items(), key=lambda item: sorted(item[0])):
                violation, override = rules.layer_kind_call(kind, rec.layer_class, runs, ran, rec.paths, mine,
                                                            batch.packed, self.settings.allow_fallback)
                self.note_override(rec, override)
                if violation is not None:
                    found.append(violation)
                    break                                   # one line per layer kind
            seen = sum((tally or {}).get(kind, {}).values()) + compiled_layers[kind]
            if present[kind] > seen:
                found.append(rules.layers_unseen(kind, rec.layer_class, present[kind], seen,
                                                 self._bypass(kind, model, mine)))
        return found

    def _bypass(self, kind: str, model, rebound: dict[str, str]) -> tuple[str, ...]:
        """What the layers of a kind that the guard did not see ran instead, as far as it can tell."""
        cls = self.layer_classes[kind]
        ours = cls.__dict__.get("forward")
        said = [f"{name} is now {now}" for name, now in sorted(rebound.items()) if name.endswith(".forward")]
        for module in model.modules():
            if not isinstance(module, cls):
                continue
            own = module.__dict__.get("forward")
            if own is not None:
                said.append(f"a {cls.__name__} layer has its own forward, {describe(own)}")
            elif getattr(type(module), "forward", None) is not ours and type(module) is not cls:
                said.append(f"{type(module).__qualname__}.forward, {describe(type(module).forward)}")
        return tuple(dict.fromkeys(said))[:3]
