"""Models outside the image's families: a process that builds a model of a type no family covers
trains with nothing proven about its kernels or its packed batches, so it gets one line, on
stderr and in the guard's record: `not covered: model_type X (this image proves: ...)`.
`FTIMAGE_REQUIRE_FAMILY=1` turns that line into a refusal (exit 3) before the model exists.

guard.boot hands over every transformers modeling module no family names, once it has executed;
this module wraps the `post_init` of its PreTrainedModel base, which every model class of the
module calls at the end of its __init__, so the line comes when a model is built, not when a
module is merely imported (transformers and TRL import modeling modules they never use).
"""
from __future__ import annotations

import os
import sys

from families import known_families, load_family, model_types_of
from guard import record, settings

REQUIRE_FAMILY_ENV = "FTIMAGE_REQUIRE_FAMILY"
SEEN: list[str] = []      # the model types reported in this process, once each (tests read it)


def proven_families() -> tuple[str, ...]:
    """What this image proves: its lock's families, else every family it ships."""
    try:
        from contracts.lock import LockError, load_lock, lock_path  # only when a model is built

        return load_lock(lock_path()).families
    except (LockError, OSError, ImportError):
        return known_families()


def line(model_types: tuple[str, ...], proven: tuple[str, ...]) -> str:
    return f"not covered: model_type {', '.join(model_types) or '(none)'} (this image proves: {', '.join(proven)})"


def covered(model_types: tuple[str, ...], proven: tuple[str, ...]) -> bool:
    return any(t in load_family(name).model_types for name in proven for t in model_types)


def on_model_built(config) -> None:
    """Called from the wrapped post_init: report (or refuse) a model of an uncovered type."""
    types = model_types_of(config)
    proven = proven_families()
    if covered(types, proven) or ",".join(types) in SEEN:
        return
    SEEN.append(",".join(types))
    text = line(types, proven)
    if settings.truthy(os.environ.get(REQUIRE_FAMILY_ENV)):
        sys.stderr.write(f"error: {record.PREFIX} refused this run: {text}\n"
                         f"  fix: train a model of a family this image proves, or unset {REQUIRE_FAMILY_ENV}\n")
        sys.stderr.flush()
        os._exit(record.REFUSED)
    record.log(f"{text}: nothing checks its fused kernels or its packed batches in this process; "
               f"{REQUIRE_FAMILY_ENV}=1 refuses it")
    record.note_uncovered(text)
    from guard import activate  # here: activate imports torch, and this runs once a model exists

    if activate.CURRENT is None:
        try:
            current = settings.read()
        except settings.BadSetting:
            return      # the guard's own activation reports a bad setting
        problem = record.write(current.report, record.uncovered_report(), current.json_logs)
        if problem:
            record.log(f"warning: {problem}")


def on_import(module) -> None:
    """Wrap the module's PreTrainedModel base(s): each model built from it reports its type."""
    for value in list(vars(module).values()):
        if (isinstance(value, type) and value.__name__.endswith("PreTrainedModel")
                and value.__module__ == module.__name__ and "post_init" not in vars(value)):
            _wrap(value)


def _wrap(cls) -> None:
    plain = cls.post_init

    def post_init(self, *args, **kwargs):
        result = plain(self, *args, **kwargs)
        on_model_built(self.config)
        return result

    post_init.__wrapped__ = plain
    cls.post_init = post_init
