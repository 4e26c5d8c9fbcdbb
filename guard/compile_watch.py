"""What the guard does about code traced by torch.compile. Dynamo traces through the guard's
wrappers, so compiled code runs without them; while it traces one, the wrapper sees
torch.compiler.is_compiling() and calls `compiled_call`, which dynamo leaves to run eagerly (a
graph break) every time the compiled code runs. In a training forward that refuses, naming
torch.compile; with FTIMAGE_GUARD_ALLOW_COMPILE=1 it is logged once and the guard records that it
is silent. Eval forwards are counted, never refused.

CompileWatch is part of guard.state.Guard: it uses the guard's window (`steps`, `close_window`),
its records and `violate()`.
"""
from __future__ import annotations

import torch

from guard import record, rules
from guard import settings as settings_mod


class CompileWatch:
    """The torch.compile half of guard.state.Guard."""

    def compiled(self, where: str, name: str, module, entering: bool) -> None:
        """A wrapper was traced by dynamo: this runs each time the compiled code reaches it (see
        compiled_call). `where`: "model", "layer" (name is the kind), "function" or "attention"."""
        if not self.active:
            return
        batch, _ = self.context()
        if batch is not None:
            training = batch.training
        elif isinstance(module, torch.nn.Module):
            training = bool(module.training and torch.is_grad_enabled())
        else:
            training = torch.is_grad_enabled()
        depth, cdepth = getattr(self.local, "depth", 0), getattr(self.local, "cdepth", 0)
        if where == "model":
            if not entering:
                self.local.cdepth = max(0, cdepth - 1)
                return
            self.local.cdepth = cdepth + 1
            if cdepth or depth:
                return                    # the backbone inside the causal LM: the same forward
            self.compiled_counts["training_forwards" if training else "eval_forwards"] += 1
            if not training:
                return
            self.steps += 1
            if self.steps > self.settings.steps:
                self.close_window()
                return
            self.compiled_steps += 1
            what = f"{name}.forward (the family's model)"
        elif not training:
            return
        elif where == "layer":
            rec = self.layers[name]
            rec.compiled += 1
            if depth and getattr(self.local, "compiled_layers", None) is not None:
                self.local.compiled_layers[name] += 1
            what = f"the {name} layers ({rec.layer_class}.forward)"
        else:
            rec = self.records.get(name)
            if rec is not None:
                rec.calls["compiled"] += 1
            what = "the attention function" if where == "attention" else name
        if where != "model":
            self.compiled_counts["training_calls"] += 1
        if what not in self.compiled_where and len(self.compiled_where) < 8:
            self.compiled_where.append(what)
        violation, override = rules.compiled_call(what, self.settings.steps, self.settings.allow_compile)
        if override and not self.silent:
            self.silent = ("the training forwards ran under torch.compile, which the guard does not check "
                           f"({settings_mod.ALLOW_COMPILE_ENV}=1)")
            self.note_override(None, override)          # once: one logged line
        if violation is not None:
            self.violate([violation])


@torch.compiler.disable(reason=f"{record.PREFIX} does not vouch for compiled training forwards: it must run "
                               f"eagerly here, to refuse them or, with {settings_mod.ALLOW_COMPILE_ENV}=1, to record "
                               "that it is silent; with fullgraph=True it cannot, and dynamo stops the compile")
def compiled_call(guard: CompileWatch, where: str, name: str, module=None, entering: bool = True) -> None:
    """Called by a wrapper only while dynamo traces it. Dynamo does not trace a disabled function: it
    breaks the graph and calls it eagerly each time the compiled code runs, so the guard learns,
    every time, that a training forward ran compiled (and refuses, or records the override)."""
    guard.compiled(where, name, module, entering)
