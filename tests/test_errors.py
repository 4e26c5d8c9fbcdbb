"""The one error type: every error that carries a fix is a contracts.errors.FixableError, the fix is
set in one place, one helper re-raises with context, and the text and exit codes the CLIs print
stay what they were."""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from contracts.errors import FixableError, headline

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
PARTS = ("build", "contracts", "entrypoint", "verify", "guard", "families", "bench")
BASE = REPO / "contracts" / "errors.py"


def project_files() -> list[Path]:
    return [p for part in PARTS for p in sorted((REPO / part).rglob("*.py")) if p != BASE]


def module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def fix_assignments(tree: ast.AST) -> list[int]:
    """Lines that set an attribute named `fix` (`self.fix = ...`, `a.b, self.fix = ...`, `x.fix += ...`)."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for inner in ast.walk(target):
                if isinstance(inner, ast.Attribute) and inner.attr == "fix" and isinstance(inner.ctx, ast.Store):
                    lines.append(node.lineno)
    return lines


def classes_taking_a_fix(tree: ast.AST) -> list[str]:
    """Classes whose own __init__ has a parameter named `fix`."""
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args
                if "fix" in {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}:
                    names.append(node.name)
    return names


def test_no_error_sets_its_fix_by_hand():
    """Only the base sets `.fix`: so an error that carries one got it from FixableError."""
    offenders = [f"{p.relative_to(REPO)}:{line}" for p in project_files()
                 for line in fix_assignments(ast.parse(p.read_text()))]
    assert not offenders, offenders


# Errors whose fix is fixed by the class, so their __init__ takes no `fix` to be found by.
FIXED_FIX = [("verify.scratch", "NoScratch"), ("entrypoint.step", "NonFiniteLoss"),
             ("families", "UnknownFamily"), ("bench.kit_runner", "ResultsNotWritable")]


def test_every_error_with_a_fix_is_a_fixable_error():
    found = [(module_of(p), name) for p in project_files() for name in classes_taking_a_fix(ast.parse(p.read_text()))]
    assert len(found) >= 20, found   # the walk sees the project's errors, not nothing
    not_based = []
    for module, name in [*found, *FIXED_FIX]:
        cls = getattr(importlib.import_module(module), name)
        if issubclass(cls, BaseException) and not issubclass(cls, FixableError):
            not_based.append(f"{module}.{name}")
    assert not not_based, not_based


def test_no_hand_written_re_raise():
    offenders = [str(p.relative_to(REPO)) for p in project_files() if '.split("\\n")[0], exc.fix' in p.read_text()]
    assert not offenders, offenders


def test_the_base_imports_the_standard_library_only():
    """guard/ imports it in every Python process of the image: nothing third-party, nothing of ours."""
    tree = ast.parse(BASE.read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_from_error_keeps_the_first_line_and_the_fix():
    from entrypoint.checkpoint.dcp import CheckpointError
    from entrypoint.launcher.preflight import FinetuneError

    cause = CheckpointError("step-00000004 is damaged\nrank 1: bad header", "delete it and resume")
    assert str(cause) == "step-00000004 is damaged\nrank 1: bad header\n  fix: delete it and resume"
    assert headline(cause) == "step-00000004 is damaged"
    err = FinetuneError.from_error(cause)
    assert type(err) is FinetuneError
    assert (str(err), err.fix, err.exit_code) == ("step-00000004 is damaged", "delete it and resume", 2)
    assert FixableError.from_error(err).render() == "error: step-00000004 is damaged\n    fix: delete it and resume"


def test_text_fields_and_exit_codes_stay_as_they_were():
    from build.audit.foreign_image import AuditRefused
    from build.cache import UnsafeFile
    from build.errors import BuildFailure, SigningError
    from build.kernels.portable import ImportRefused
    from contracts.folder_guard import UnsafeFolder
    from contracts.lock import LockError
    from entrypoint.checkpoint.safetensors_header import MALFORMED_FIX, HeaderError
    from entrypoint.data.sources import DataError
    from entrypoint.inputs import InputError
    from entrypoint.launcher.preflight import EXIT_GATE, FinetuneError
    from entrypoint.model import ModelError
    from entrypoint.observability.tracker_check import TrackerUnavailable
    from entrypoint.step import NonFiniteLoss
    from guard.settings import BadSetting

    # the fix on its own line of str() where it was, and only there
    model = ModelError("no config.json", "point model.path at it")
    assert str(model) == "no config.json\n  fix: point model.path at it"
    data = DataError("no rows", "check the data")
    assert (str(data), data.fix, data.field, data.message) == ("no rows\n  fix: check the data", "check the data",
                                                               "data.path", "no rows")
    assert (str(InputError("m", "f")), InputError("m", "f").field) == ("m", "")
    tracker = TrackerUnavailable("wandb", "no API key", "set WANDB_API_KEY")
    assert (str(tracker), tracker.fix, tracker.tracker, tracker.cause) == (
        "output.report_to: wandb cannot start: no API key", "set WANDB_API_KEY", "wandb", "no API key")
    loss = NonFiniteLoss(7, "loss", float("nan"))
    assert str(loss).startswith("the loss became nan at step 7; stopping before the optimizer step")
    assert str(loss).endswith("\n  fix: lower train.lr or raise train.warmup_steps, check the data (inspect-data), "
                              "and resume from the last checkpoint")
    assert loss.fix == "lower train.lr or raise train.warmup_steps, check the data, resume from the last checkpoint"
    setting = BadSetting("FTIMAGE_GUARD_STEPS=x is not a number", "set a number")
    assert (str(setting), setting.problem, setting.fix) == ("FTIMAGE_GUARD_STEPS=x is not a number",) * 2 + (
        "set a number",)
    header = HeaderError("bad header")
    assert isinstance(header, ValueError) and header.fix == MALFORMED_FIX

    # render(): the build CLI's one text, a fix line only when there is a fix
    assert BuildFailure("compile failed").render() == "error: compile failed"
    assert BuildFailure("compile failed", "read the log").render() == "error: compile failed\n    fix: read the log"
    assert AuditRefused("no such image", "pull it").render() == "error: no such image\n    fix: pull it"
    assert isinstance(UnsafeFile("a symlink"), ValueError)

    # exit codes, as the CLIs map each class
    assert (BuildFailure.exit_code, UnsafeFile.exit_code, SigningError.exit_code, UnsafeFolder.exit_code,
            ImportRefused.exit_code, AuditRefused.exit_code, LockError.exit_code, BadSetting.exit_code) == \
           (1, 1, 2, 2, 3, 2, 1, 2)
    assert FinetuneError("m", "f").exit_code == 2
    assert FinetuneError("gate", "f", exit_code=EXIT_GATE).exit_code == 3
