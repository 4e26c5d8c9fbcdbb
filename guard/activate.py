"""Activation: guard.boot calls `on_import` once the family's modeling module has executed (torch
and transformers are imported by then). Reads the settings, says so when the guard is off,
attaches the wrappers (guard.wrap), and writes the report at exit if the window never ended.

It fails closed: a malformed setting exits 2 with one line; a guard that cannot attach exits 3
rather than let training run unchecked.
"""
from __future__ import annotations

import atexit
import os
import sys

from families import load_family
from guard import record, settings, wrap
from guard.state import Guard

CURRENT: Guard | None = None     # this process's guard, once active (tests and tools read it)


def _fail(code: int, problem: str, fix: str) -> None:
    try:
        sys.stderr.write(f"error: {record.PREFIX}: {problem}\n  fix: {fix}\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


def _is_verify() -> bool:
    """`python -m verify`: the proof runs the torch fallback on packed documents on purpose, to
    measure the leak it reports; the guard leaves that one process alone."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", "") == "verify.__main__"


def on_import(module, family_name: str) -> None:
    global CURRENT
    if _is_verify():
        return
    try:
        current = settings.read()
    except settings.BadSetting as exc:
        _fail(record.BAD_SETTING, exc.problem, exc.fix)
        return
    if not current.enabled:
        record.log(f"off ({settings.GUARD_ENV}=off): {module.__name__} runs without the runtime check of its fused "
                   "kernels and packed-batch boundaries in this process")
        problem = record.write(current.report, record.off_report(module.__name__, family_name), current.json_logs)
        if problem:
            record.log(f"warning: {problem}")
        return
    try:
        family = load_family(family_name)
        guard = Guard(current, family, module.__name__)
        wrap.install(guard, module, family)
    except Exception as exc:  # noqa: BLE001 - fail closed, in one line
        _fail(record.REFUSED, f"could not attach to {module.__name__}: {type(exc).__name__}: {exc}",
              f"use the image's own transformers and families/; {settings.GUARD_ENV}=off runs without the guard "
              "(logged)")
        return
    CURRENT = guard
    record.GUARDS.append(guard)
    atexit.register(guard.at_exit)
