"""The guard's record and its voice: the machine-readable report (written atomically where
FTIMAGE_GUARD_REPORT points, and one JSON line on stderr with FTIMAGE_JSON_LOGS=1), the one-line
summary when the window ends, and the refusal: one error, its fixes, exit 3.

The refusal may run inside an autograd backward hook or on a worker thread, where an exception
would be swallowed, wrapped or printed with a traceback; so it writes the report, flushes, and
leaves with os._exit (the gate's refusal code).
"""
from __future__ import annotations

import os
import sys
from typing import Any

from contracts import atomic
from contracts.events import EventLog

# `guard` below is a guard.state.Guard, `rec` its FunctionRecord and `layer` its LayerRecord; not
# imported here, since state imports this module (to report and refuse)
Guard = FunctionRecord = LayerRecord = Any

SCHEMA = "ftimage.guard/1"
REFUSED = 3          # the gate's refusal code (`ftimage-gate` exits 3 when it refuses to run a command)
BAD_SETTING = 2      # a malformed FTIMAGE_GUARD* value
PREFIX = "ftimage-guard"


UNCOVERED: list[str] = []   # "not covered: model_type X (...)" lines of this process (guard.coverage)


def note_uncovered(text: str) -> None:
    UNCOVERED.append(text)


def uncovered_report() -> dict[str, Any]:
    """The record of a process that built only models no family covers (no guard attached)."""
    return {"schema": SCHEMA, "status": "not covered", "pid": os.getpid(), "rank": _rank(), "argv": list(sys.argv),
            "not_covered": list(UNCOVERED)}


def log(message: str) -> None:
    sys.stderr.write(f"{PREFIX}: {message}\n")
    sys.stderr.flush()


def _rank() -> int | None:
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else None


def layer_ran(layer: LayerRecord | None) -> int:
    return (layer.runs + layer.recompute + layer.outside) if layer is not None else 0


def verdict(guard: Guard, rec: FunctionRecord) -> str:
    if any(v.function == rec.function for v in guard.violations):
        return "refused"
    if rec.override:
        return "fallback allowed"
    trained = rec.calls["forward_fused"] + rec.calls["forward_torch"] + rec.calls["recompute"]
    if trained:
        return "pass"
    layer = guard.layers.get(rec.kind)
    if rec.calls.get("compiled") or (layer is not None and layer.compiled):
        return "not seen: compiled"
    if layer_ran(layer):
        # never "not run" beside a layer kind that ran: either it ran another complete path, or the
        # kind's own verdict refused it
        if any(v.function == rec.kind for v in guard.violations):
            return "not run while its layer ran"
        return "not on the path that ran"
    return "eval only" if rec.calls["eval"] else "not run"


def layer_verdict(guard: Guard, layer: LayerRecord) -> str:
    if any(v.function == layer.kind for v in guard.violations):
        return "refused"
    if layer.compiled:
        return "silent: compiled" if guard.settings.allow_compile else "refused"
    if layer.override:
        return "fallback allowed"
    if layer_ran(layer):
        return "pass"
    return "eval only" if layer.eval else "not run"


def layer_entry(guard: Guard, layer: LayerRecord) -> dict[str, Any]:
    names = {b.name for b in guard.bindings if b.kind == layer.kind}
    return {
        "layer_class": layer.layer_class, "paths": [list(p) for p in layer.paths], "present": layer.present,
        "forward": layer.runs, "recompute": layer.recompute, "outside_family_model": layer.outside,
        "compiled": layer.compiled, "eval": layer.eval, "paths_ran": dict(layer.paths_ran),
        "rebound": {name: now for name, now in sorted(guard.rebound.items()) if name in names},
        "verdict": layer_verdict(guard, layer), "override": layer.override or None,
    }


def function_entry(guard: Guard, rec: FunctionRecord) -> dict[str, Any]:
    return {
        "kind": rec.kind, "wrapper": rec.wrapper, "boundary_kwarg": rec.boundary_kwarg,
        "bound": rec.bound, "fused": rec.fused, "why_torch": rec.why or None,
        "forward": {"fused": rec.calls["forward_fused"], "torch": rec.calls["forward_torch"],
                    "recompute": rec.calls["recompute"], "eval": rec.calls["eval"], "compiled": rec.calls["compiled"]},
        "backward": {"fused": rec.calls["backward_fused"], "torch": rec.calls["backward_torch"]},
        "ran_forward": sorted(rec.forward_impls), "ran_backward": sorted(rec.backward_impls),
        "packed_calls": rec.packed_calls, "boundaries_present": rec.boundary_present,
        "boundaries_missing": rec.boundary_missing, "verdict": verdict(guard, rec), "override": rec.override or None,
    }


def status(guard: Guard) -> str:
    if guard.violations:
        return "refused"
    if guard.silent:
        return "silent"     # compiled training forwards, let through by the override: nothing vouched for
    if not guard.batches["training"] and not guard.unattributed and not any(
            layer.outside for layer in guard.layers.values()):
        return "no training step"
    return "fallback allowed" if guard.overrides else "pass"


def build(guard: Guard) -> dict[str, Any]:
    s = guard.settings
    return {
        "schema": SCHEMA, "status": status(guard), "family": guard.family.name, "modeling_module": guard.module_name,
        "pid": os.getpid(), "rank": _rank(), "argv": list(sys.argv),
        "window": {"steps": s.steps, "checked": max(0, min(guard.steps, s.steps) - guard.compiled_steps),
                   "ended": guard.window_ended},
        "settings": {"FTIMAGE_GUARD": "on", "FTIMAGE_GUARD_STEPS": s.steps, "FTIMAGE_ALLOW_FALLBACK": s.allow_fallback,
                     "FTIMAGE_GUARD_ALLOW_COMPILE": s.allow_compile},
        "batches": {**guard.batches, "boundary_kwargs": sorted(guard.kwargs_seen),
                    "position_ids": sorted(guard.layouts), "outside_family_model": guard.unattributed},
        "layers": {kind: layer_entry(guard, layer) for kind, layer in guard.layers.items()},
        "functions": {name: function_entry(guard, rec) for name, rec in guard.records.items()},
        "compiled": {**guard.compiled_counts, "steps": guard.compiled_steps, "where": list(guard.compiled_where),
                     "allowed": s.allow_compile},
        "silent": guard.silent or None,
        "rebound": dict(sorted(guard.rebound.items())),
        "violations": [{"function": v.function, "message": v.message, "fix": list(v.fix)} for v in guard.violations],
        "overrides": list(guard.overrides),
        "warnings": list(guard.warnings),
        "not_covered": list(UNCOVERED),
        **({"experts": guard.experts.to_dict()} if guard.experts is not None else {}),
    }


def off_report(module_name: str, family: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "status": "off", "family": family, "modeling_module": module_name,
            "pid": os.getpid(), "rank": _rank(), "argv": list(sys.argv), "settings": {"FTIMAGE_GUARD": "off"}}


def write(path: str, data: dict[str, Any], json_logs: bool) -> str:
    """Write the report (atomically) and/or its JSON line; '' or why the file could not be written."""
    problem = ""
    if path:
        try:
            atomic.write_json(path, data, sort_keys=True)
        except OSError as exc:
            problem = f"the report could not be written to {path}: {exc}"
    if json_logs:
        EventLog(json_lines=True).emit("guard", f"guard {data['status']}", step=data["status"], report=data)
    return problem


GUARDS: list[Guard] = []   # every guard of this process, one per family modeling module imported


def publish(guard: Guard, data: dict[str, Any]) -> None:
    """Write the report, unless another family's guard in this process trained and this one never
    saw its own model train: a process imports other modeling modules (a kernel, a library) and
    the report is about the model that trained."""
    if guard.steps == 0 and any(other.steps for other in GUARDS if other is not guard):
        return
    problem = write(guard.settings.report, data, guard.settings.json_logs)
    if problem:
        log(f"warning: {problem}")


def summary(guard: Guard, data: dict[str, Any]) -> str:
    parts = []
    for kind, entry in data["layers"].items():
        more = [f"{entry[key]} {what}" for key, what in (("recompute", "recomputed in backward"),
                                                         ("outside_family_model", "outside the model's forward"),
                                                         ("compiled", "compiled, not checked")) if entry[key]]
        paths = ", ".join(f"{label} ({n})" for label, n in entry["paths_ran"].items()) or "none seen"
        parts.append(f"{kind} ({entry['layer_class']}): {entry['verdict']}, ran {entry['forward']} time(s)"
                     + "".join(f", {m}" for m in more) + f", path {paths}")
    for name, entry in data["functions"].items():
        ran = ", ".join(entry["ran_forward"]) or "none"
        back = ", ".join(entry["ran_backward"]) or "none"
        parts.append(f"{name}: {entry['verdict']}, forward {ran} ({entry['forward']['fused']} fused, "
                     f"{entry['forward']['torch']} torch), backward {back} ({entry['backward']['fused']} fused, "
                     f"{entry['backward']['torch']} torch)")
    parts += [f"{name} rebound to {now}" for name, now in data["rebound"].items()]
    if data["silent"]:
        parts.insert(0, f"{data['compiled']['training_forwards']} compiled training forward(s) and "
                        f"{data['compiled']['training_calls']} compiled layer or kernel call(s) not checked: "
                        f"{data['silent']}")
    packed = data["batches"]["packed"]
    kwargs = ", ".join(data["batches"]["boundary_kwargs"]) or "none"
    where = f"; report: {guard.settings.report}" if guard.settings.report else ""
    return (f"{data['status']}: checked {data['window']['checked']} training step(s) ({packed} packed, boundary "
            f"kwargs: {kwargs}); " + "; ".join(parts) + f"; not checked from here on{where}")


def refusal_text(guard: Guard, problem: str) -> str:
    rank = _rank()
    where = f"training step {guard.steps}" + (f", rank {rank}" if rank is not None else "")
    first, *rest = guard.violations
    lines = [f"error: {PREFIX} refused this run (model family {guard.family.name}, {where}): {first.message}"]
    lines += [f"  and: {v.message}" for v in rest]
    # one line per distinct fix: the torch-path alternative, say, is shared by every fallback
    fixes = list(dict.fromkeys(line for v in guard.violations for line in v.fix))
    lines += [f"  fix: {fix}" for fix in fixes]
    if guard.settings.report and not problem:
        lines.append(f"  report: {guard.settings.report}")
    if problem:
        lines.append(f"  warning: {problem}")
    return "\n".join(lines) + "\n"


def refuse(guard: Guard) -> None:
    """Report, say it once, exit 3. Never returns."""
    try:
        problem = write(guard.settings.report, build(guard), guard.settings.json_logs)
        text = refusal_text(guard, problem)
    except BaseException as exc:  # noqa: BLE001 - the refusal must happen whatever the report does
        text = f"error: {PREFIX} refused this run: {guard.violations[0].message if guard.violations else '?'} " \
               f"(and the report failed: {type(exc).__name__}: {exc})\n"
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        os.write(2, text.encode(errors="replace"))
    os._exit(REFUSED)
