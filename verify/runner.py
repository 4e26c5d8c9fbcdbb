"""run_checks: the library entry the entrypoint calls before training (fail closed)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path

from contracts.errors import FixableError
from contracts.lock import LockError, load_lock, lock_path
from families import (
    DEFAULT_FAMILY,
    FamilyError,
    UnknownFamily,
    family_of_config,
    known_families,
    load_family,
    model_types_of,
)
from verify.checks.model_fit import ModelConfigError, read_model_config
from verify.context import Context
from verify.report import CheckResult, Report, Status
from verify.scratch import NoScratch, ensure_scratch

# Order matters for reading the table: what is installed, whether the model fits what was
# compiled, what transformers picked, whether the kernels compute the right thing, whether
# packing stays isolated.
CHECKS: tuple[str, ...] = ("environment", "model_fit", "dispatch", "fused_ops", "isolation")
# Run by default only with --no-lock (the audit of a foreign image); any image may ask for them.
AUDIT_CHECKS: tuple[str, ...] = ("extensions",)
ALL_CHECKS: tuple[str, ...] = ("environment", "extensions", "model_fit", "dispatch", "fused_ops", "isolation")
NO_LOCK_DETAIL = ("no lock read (--no-lock): the audit of an image without an ftimage lock, so every row that "
                  "compares with a lock is SKIP")
PARAM_DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("auto", "cuda", "cpu")


class UsageError(FixableError):
    """Bad arguments; carries a fix like every other error the user sees."""

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def parse_checks(spec: str | Iterable[str] | None, *, no_lock: bool = False) -> tuple[str, ...]:
    if spec is None:
        return ALL_CHECKS if no_lock else CHECKS
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in ALL_CHECKS]
    if unknown or not names:
        raise UsageError(f"unknown check(s): {', '.join(unknown) or '(none given)'}",
                         f"choose from: {','.join(CHECKS)} (and {','.join(AUDIT_CHECKS)})")
    return tuple(n for n in ALL_CHECKS if n in names)


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}", f"use one of: {', '.join(DEVICES)}")
    if device != "auto":
        return device
    import torch  # only to find the device: `verify --help` and a usage error start without torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _lock_row(path: Path) -> tuple[CheckResult, object]:
    try:
        lock = load_lock(path)
    except LockError as exc:
        return CheckResult("lock", Status.FAIL, str(exc), exc.fix), None
    return CheckResult("lock", Status.PASS, f"{path}: image={lock.image} sha256={lock.sha256()[:12]} "
                       f"torch={lock.torch} cuda={lock.cuda} "
                       f"{'families' if len(lock.families) > 1 else 'family'}={','.join(lock.families)}",
                       data={"path": str(path), "sha256": lock.sha256()}), lock


def run_checks(checks: str | Sequence[str] | None = None, *, device: str = "auto",
               lock: str | os.PathLike | None = None, deep: bool = False, model: str | os.PathLike | None = None,
               param_dtype: str = "bfloat16", no_lock: bool = False, families: str | None = None) -> Report:
    """Run the selected checks and return the report.

    Environment problems (no lock, no GPU, a crashing check) become FAIL rows, never exceptions;
    only bad arguments raise UsageError (with a fix). The entrypoint gates on `report.passed`;
    only its own --allow-fallback / FTIMAGE_ALLOW_FALLBACK=1 may override that.

    no_lock: read no lock at all (the audit of an image this project did not build): the lock
    row and every row that compares "as locked" are SKIP with that reason, and the extensions
    rows run by default. It is never a stand-in lock: nothing is compared with one.
    """
    if no_lock and lock:
        raise UsageError("--lock and --no-lock contradict each other", "give one of them")
    names = parse_checks(checks, no_lock=no_lock)
    try:
        ensure_scratch()
    except NoScratch as exc:
        return Report.of([CheckResult("environment.scratch", Status.FAIL, str(exc), exc.fix)])
    if param_dtype not in PARAM_DTYPES:
        raise UsageError(f"unknown param dtype {param_dtype!r}", f"use one of: {', '.join(PARAM_DTYPES)}")
    resolved = resolve_device(device)
    if no_lock:
        lock_row, build_lock = CheckResult("lock", Status.SKIP, NO_LOCK_DETAIL, data={"no_lock": True}), None
    else:
        lock_row, build_lock = _lock_row(Path(lock) if lock else lock_path())
    proven = parse_families(families) or (build_lock.families if build_lock else (DEFAULT_FAMILY,))
    rows = [lock_row]
    model_config, model_source = None, ""
    if model:
        try:
            model_config, model_source = read_model_config(model), f"{model}/config.json"
        except ModelConfigError as exc:
            rows.append(CheckResult("model_fit.config", Status.FAIL, str(exc), exc.fix))
    checked, family_row = families_to_check(proven, model_config, model_source, audit=build_lock is None)
    if build_lock is None:
        rows[0] = CheckResult(lock_row.check, lock_row.status,
                              f"{lock_row.detail} (the probes assume model family {', '.join(checked) or '-'})",
                              lock_row.fix, lock_row.data)
    if family_row is not None:
        rows.append(family_row)
    def context(family) -> Context:
        return Context(lock=build_lock, device=resolved, family=family, deep=deep, model_config=model_config,
                       model_source=model_source, param_dtype=param_dtype, no_lock=no_lock)

    contexts = []
    for family_name in checked:
        family = None
        try:
            family = load_family(family_name)
        except (UnknownFamily, FamilyError) as exc:
            rows.append(CheckResult(f"model_family.{family_name}", Status.FAIL, str(exc).splitlines()[0],
                                    getattr(exc, "fix", "reinstall the image")))
        contexts.append(context(family))
    # no family to prove: the family-free checks still run, every other one FAILs
    contexts = contexts or [context(None)]
    for name in names:
        if name in FAMILY_CHECKS:
            for ctx in contexts:
                found = _run_one(name, ctx)
                rows.extend(named_for(ctx.family.name, found) if len(contexts) > 1 and ctx.family else found)
        else:
            rows.extend(_run_one(name, contexts[0]))
    return Report.of(rows)


def parse_families(spec: str | None) -> tuple[str, ...]:
    """`--families a,b` or `all`; empty: not given."""
    if spec is None:
        return ()
    known = known_families()
    if spec.strip() == "all":
        return known
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"unknown model famil{'ies' if len(unknown) > 1 else 'y'}: "
                         f"{', '.join(unknown) or '(none given)'}", f"choose from: {','.join(known)}, or all")
    return names


def families_to_check(proven: tuple[str, ...], model_config: dict | None, model_source: str, *,
                      audit: bool) -> tuple[tuple[str, ...], CheckResult | None]:
    """(the families to prove, the row saying why). With a model mounted: the one family its
    config.json's model_type names, among those the image proves (any known family for an audit);
    a model type none covers is refused, naming what the image does cover. Without: every one."""
    if model_config is None:
        return proven, None
    if not model_types_of(model_config):
        return proven, CheckResult("model_family", Status.WARN, f"{model_source} names no model_type, so it "
                                   f"cannot be matched to a family; proving every family of the image: "
                                   f"{', '.join(proven)}", "mount the model's own config.json (transformers "
                                   "writes model_type into every one)")
    pool = known_families() if audit else proven
    found = family_of_config(model_config, pool)
    types = ", ".join(model_types_of(model_config)) or "(none)"
    if found is None:
        return (), CheckResult("model_family", Status.FAIL,
                               f"not covered: model_type {types} ({model_source}); this image proves: "
                               f"{', '.join(proven)}",
                               "train a model of a family the image proves, or build an image whose "
                               "model_families lists this model's family (families/*.yaml)",
                               data={"model_types": list(model_types_of(model_config)), "proven": list(proven)})
    return (found,), CheckResult("model_family", Status.PASS, f"model_type {types} ({model_source}) is family "
                                 f"{found}; this image proves: {', '.join(proven)}", data={"family": found})


def named_for(family: str, rows: list[CheckResult]) -> list[CheckResult]:
    """The same rows, each named for its family (`dispatch.<family>.<function>`), when an image
    proves several families."""
    renamed = []
    for row in rows:
        check, _, rest = row.check.partition(".")
        name = f"{check}.{family}.{rest}" if rest else f"{check}.{family}"
        renamed.append(CheckResult(name, row.status, row.detail, row.fix, row.data))
    return renamed


FAMILY_CHECKS = ("extensions", "model_fit", "dispatch", "fused_ops", "isolation")


def _run_one(name: str, ctx: Context) -> list[CheckResult]:
    if name in FAMILY_CHECKS and ctx.family is None:
        return [CheckResult(name, Status.FAIL, "no usable model family (see model_family row)",
                            "fix the model family first")]
    module = importlib.import_module(f"verify.checks.{name}")
    missing = [m for m in getattr(module, "REQUIRES", ()) if importlib.util.find_spec(m) is None]
    if missing:
        # These checks prove the fast path through that code; unable to run, they prove nothing,
        # so they fail closed with the reason instead of crashing.
        return [CheckResult(name, Status.FAIL, f"cannot run: {', '.join(missing)} is not installed in this image, "
                            f"and this check proves the fused path through its modeling code",
                            f"add {', '.join(missing)} to the image's python.requirements and rebuild, or run "
                            "verify --checks environment,model_fit for a kernels-only image")]
    try:
        rows = module.run(ctx)
    except Exception as exc:  # noqa: BLE001 - a crashing check must still fail closed, readably
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return [CheckResult(name, Status.FAIL,
                            f"check crashed: {type(exc).__name__}: {exc} (at {Path(where.filename).name}:"
                            f"{where.lineno})", "report this as a verify bug, with `verify --json` output")]
    return rows
