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
from families import DEFAULT_FAMILY, FamilyError, UnknownFamily, load_family
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
                       f"torch={lock.torch} cuda={lock.cuda} family={lock.model_family}",
                       data={"path": str(path), "sha256": lock.sha256()}), lock


def run_checks(checks: str | Sequence[str] | None = None, *, device: str = "auto",
               lock: str | os.PathLike | None = None, deep: bool = False, model: str | os.PathLike | None = None,
               param_dtype: str = "bfloat16", no_lock: bool = False) -> Report:
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
    family = None
    family_name = build_lock.model_family if build_lock else DEFAULT_FAMILY
    if build_lock is None:
        lock_row = CheckResult(lock_row.check, lock_row.status,
                               f"{lock_row.detail} (the probes assume model family {family_name})", lock_row.fix)
    rows = [lock_row]
    try:
        family = load_family(family_name)
    except (UnknownFamily, FamilyError) as exc:
        rows.append(CheckResult("model_family", Status.FAIL, str(exc).splitlines()[0],
                                getattr(exc, "fix", "reinstall the image")))
    model_config, model_source = None, ""
    if model:
        try:
            model_config, model_source = read_model_config(model), f"{model}/config.json"
        except ModelConfigError as exc:
            rows.append(CheckResult("model_fit.config", Status.FAIL, str(exc), exc.fix))
    ctx = Context(lock=build_lock, device=resolved, family=family, deep=deep, model_config=model_config,
                  model_source=model_source, param_dtype=param_dtype, no_lock=no_lock)

    for name in names:
        rows.extend(_run_one(name, ctx))
    return Report.of(rows)


def _run_one(name: str, ctx: Context) -> list[CheckResult]:
    needs_family = name in ("extensions", "model_fit", "dispatch", "fused_ops", "isolation")
    if needs_family and ctx.family is None:
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
