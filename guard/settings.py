"""The guard's environment, read once at activation: on/off, how many training steps to check,
where the report goes, the fallback and compile overrides, JSON logs. A malformed value is one
clear error."""
from __future__ import annotations

import os
from dataclasses import dataclass

from contracts.errors import FixableError

GUARD_ENV = "FTIMAGE_GUARD"                # on (default) | off
STEPS_ENV = "FTIMAGE_GUARD_STEPS"          # training steps to check, default 2
REPORT_ENV = "FTIMAGE_GUARD_REPORT"        # where the JSON report is written (atomically)
ALLOW_FALLBACK_ENV = "FTIMAGE_ALLOW_FALLBACK"   # the name entrypoint.console uses (a test holds them equal)
JSON_LOGS_ENV = "FTIMAGE_JSON_LOGS"        # "1": the report also goes to stderr as one JSON line
ALLOW_COMPILE_ENV = "FTIMAGE_GUARD_ALLOW_COMPILE"   # "1": compiled training forwards run unchecked, logged

DEFAULT_STEPS = 2
MAX_STEPS = 1_000_000
ON, OFF = ("", "1", "on", "true", "yes"), ("0", "off", "false", "no")
# an override is read strictly: a typo must not silently leave it off (or on)
YES, NO = ("1", "on", "true", "yes"), ("", "0", "off", "false", "no")


class BadSetting(FixableError):
    exit_code = 2   # guard/record.py: BAD_SETTING

    def __init__(self, problem: str, fix: str):
        super().__init__(problem, fix)
        self.problem = problem


def truthy(value: str | None) -> bool:
    """The same reading as entrypoint.console.truthy."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    steps: int = DEFAULT_STEPS
    report: str = ""               # "" = no file
    allow_fallback: bool = False
    json_logs: bool = False
    allow_compile: bool = False


def report_path(path: str, env) -> str:
    """Rank 0 (or a single process) writes `path`; rank N of a multi-process job writes
    `<stem>.rank<N><suffix>` beside it, so ranks never overwrite each other."""
    rank, world = env.get("RANK", ""), env.get("WORLD_SIZE", "")
    if not path or not rank.isdigit() or not world.isdigit() or int(world) <= 1 or int(rank) == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{int(rank)}{ext}"


def read(env=None) -> Settings:
    env = os.environ if env is None else env
    mode = env.get(GUARD_ENV, "").strip().lower()
    if mode not in ON + OFF:
        raise BadSetting(f"{GUARD_ENV}={env.get(GUARD_ENV)!r} is neither on nor off",
                         f"set {GUARD_ENV}=on (the default) or {GUARD_ENV}=off")
    raw = env.get(STEPS_ENV, "").strip()
    steps = DEFAULT_STEPS
    if raw:
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_STEPS:
            raise BadSetting(f"{STEPS_ENV}={env.get(STEPS_ENV)!r} is not a whole number of steps from 1 to {MAX_STEPS}",
                             f"set {STEPS_ENV} to how many training steps to check, e.g. {STEPS_ENV}={DEFAULT_STEPS}, "
                             f"or {GUARD_ENV}=off to check none")
        steps = int(raw)
    compile_raw = env.get(ALLOW_COMPILE_ENV, "").strip().lower()
    if compile_raw not in YES + NO:
        raise BadSetting(f"{ALLOW_COMPILE_ENV}={env.get(ALLOW_COMPILE_ENV)!r} is neither 1 nor 0",
                         f"set {ALLOW_COMPILE_ENV}=1 to train compiled forwards without the guard's check (logged), "
                         f"or unset it (the default, 0) so that the guard refuses them")
    return Settings(enabled=mode not in OFF, steps=steps, report=report_path(env.get(REPORT_ENV, "").strip(), env),
                    allow_fallback=truthy(env.get(ALLOW_FALLBACK_ENV)), json_logs=env.get(JSON_LOGS_ENV) == "1",
                    allow_compile=compile_raw in YES)
