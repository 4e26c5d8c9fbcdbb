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

# `guard` below is a guard.state.Guard and `rec` its FunctionRecord; not imported here, since
# state imports this module (to report and refuse)
Guard = FunctionRecord = Any

SCHEMA = "ftimage.guard/1"
REFUSED = 3          # the gate's refusal code (`ftimage-gate` exits 3 when it refuses to run a command)
BAD_SETTING = 2      # a malformed FTIMAGE_GUARD* value
PREFIX = "ftimage-guard"


def log(message: str) -> None:
    sys.stderr.write(f"{PREFIX}: {message}\n")
    sys.stderr.flush()


def _rank() -> int | None:
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else None


def verdict(guard: Guard, rec: FunctionRecord) -> str:
    if any(v.function == rec.function for v in guard.violations):
        return "refused"
    if rec.override:
        return "fallback allowed"
    trained = rec.calls["forward_fused"] + rec.calls["forward_torch"] + rec.calls["recompute"]
    if trained:
        return "pass"
    return "eval only" if rec.calls["eval"] else "not run"


def function_entry(guard: Guard, rec: FunctionRecord) -> dict[str, Any]:
    return {
        "kind": rec.kind, "wrapper": rec.wrapper, "boundary_kwarg": rec.boundary_kwarg,
        "bound": rec.bound, "fused": rec.fused, "why_torch": rec.why or None,
        "forward": {"fused": rec.calls["forward_fused"], "torch": rec.calls["forward_torch"],
                    "recompute": rec.calls["recompute"], "eval": rec.calls["eval"]},
        "backward": {"fused": rec.calls["backward_fused"], "torch": rec.calls["backward_torch"]},
        "ran_forward": sorted(rec.forward_impls), "ran_backward": sorted(rec.backward_impls),
        "packed_calls": rec.packed_calls, "boundaries_present": rec.boundary_present,
        "boundaries_missing": rec.boundary_missing, "verdict": verdict(guard, rec), "override": rec.override or None,
    }


def status(guard: Guard) -> str:
    if guard.violations:
        return "refused"
    if not guard.batches["training"] and not guard.unattributed:
        return "no training step"
    return "fallback allowed" if guard.overrides else "pass"


def build(guard: Guard) -> dict[str, Any]:
    s = guard.settings
    return {
        "schema": SCHEMA, "status": status(guard), "family": guard.family.name, "modeling_module": guard.module_name,
        "pid": os.getpid(), "rank": _rank(), "argv": list(sys.argv),
        "window": {"steps": s.steps, "checked": min(guard.steps, s.steps), "ended": guard.window_ended},
        "settings": {"FTIMAGE_GUARD": "on", "FTIMAGE_GUARD_STEPS": s.steps, "FTIMAGE_ALLOW_FALLBACK": s.allow_fallback},
        "batches": {**guard.batches, "boundary_kwargs": sorted(guard.kwargs_seen),
                    "position_ids": sorted(guard.layouts), "outside_family_model": guard.unattributed},
        "functions": {name: function_entry(guard, rec) for name, rec in guard.records.items()},
        "violations": [{"function": v.function, "message": v.message, "fix": list(v.fix)} for v in guard.violations],
        "overrides": list(guard.overrides),
        "warnings": list(guard.warnings),
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


def publish(guard: Guard, data: dict[str, Any]) -> None:
    problem = write(guard.settings.report, data, guard.settings.json_logs)
    if problem:
        log(f"warning: {problem}")


def summary(guard: Guard, data: dict[str, Any]) -> str:
    parts = []
    for name, entry in data["functions"].items():
        ran = ", ".join(entry["ran_forward"]) or "not run"
        back = ", ".join(entry["ran_backward"]) or "none"
        parts.append(f"{name}: {entry['verdict']}, forward {ran} ({entry['forward']['fused']} fused, "
                     f"{entry['forward']['torch']} torch), backward {back} ({entry['backward']['fused']} fused, "
                     f"{entry['backward']['torch']} torch)")
    packed = data["batches"]["packed"]
    kwargs = ", ".join(data["batches"]["boundary_kwargs"]) or "none"
    where = f"; report: {guard.settings.report}" if guard.settings.report else ""
    return (f"{data['status']}: checked {data['window']['checked']} training step(s) ({packed} packed, boundary "
            f"kwargs: {kwargs}); " + "; ".join(parts) + f"; not checked from here on{where}")


def refusal_text(guard: Guard, problem: str) -> str:
    rank = _rank()
    where = f"training step {guard.steps}" + (f", rank {rank}" if rank is not None else "")
    first, *rest = guard.violations
    lines = [f"error: {PREFIX} refused this run ({where}): {first.message}"]
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
