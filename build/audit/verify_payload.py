"""What `audit` mounts into a foreign image: this checkout's verify (with contracts and
families, which it imports), and pure-Python copies of the third-party modules verify needs
that the image lacks, taken from this host.

Everything is staged in one temp folder, mounted read-only; the carried modules go on sys.path
BEHIND the image's own site-packages, so the image's own versions win wherever it has them.
Compiled extensions are never carried (they would be this host's build for this host's
Python): a module that has no pure-Python form cannot travel, and the audit says so. PyYAML is
pure Python without its optional C extension (yaml/__init__ falls back when _yaml is absent).
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import FixableError

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("verify", "contracts", "families")
# What is being audited: the image's own or nothing. Never carried from this host.
IMAGE_OWN = frozenset({"torch", "transformers", "triton", "fla", "flash_attn", "causal_conv1d", "numpy"})
REQUIRED_FROM_IMAGE = ("torch", "transformers")
CARRY_SUFFIXES = (".py", ".typed")


class PayloadError(FixableError):
    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


@dataclass(frozen=True)
class Carried:
    module: str
    distribution: str
    version: str
    files: int

    def describe(self) -> str:
        return f"{self.distribution} {self.version} ({self.files} pure-Python files from this host)"


def third_party_imports(root: Path = REPO_ROOT) -> tuple[str, ...]:
    """The top-level modules verify, contracts and families import that are neither the
    standard library nor this project (e.g. torch, transformers, yaml, packaging)."""
    found: set[str] = set()
    for part in PROJECT_PACKAGES:
        for path in sorted((root / part).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return tuple(sorted(n for n in found if n not in sys.stdlib_module_names and n not in PROJECT_PACKAGES
                        and n != "__future__"))


def to_carry(imports: tuple[str, ...]) -> tuple[str, ...]:
    """The ones that may travel when the image lacks them (not what is being audited)."""
    return tuple(n for n in imports if n not in IMAGE_OWN)


def distribution_of(module: str) -> str:
    names = importlib.metadata.packages_distributions().get(module) or []
    return names[0] if names else module


def _copy_tree(src: Path, dest: Path, *, suffixes: tuple[str, ...] | None) -> int:
    """Regular files only (no symlinks followed), no __pycache__; `suffixes` None copies all."""
    copied = 0
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if "__pycache__" in rel.parts or path.is_symlink() or not path.is_file() or path.suffix == ".pyc":
            continue
        if suffixes is not None and not path.name.endswith(suffixes):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied += 1
    return copied


def carry_module(module: str, deps: Path) -> Carried:
    """Copy this host's pure-Python form of `module` into deps/."""
    spec = importlib.util.find_spec(module)
    fix = f"install {distribution_of(module)} on this host (pip install {distribution_of(module)}), or into the image"
    if spec is None:
        raise PayloadError(f"verify needs `{module}`, which neither the image nor this host has", fix)
    dist = distribution_of(module)
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    if spec.submodule_search_locations:
        files = sum(_copy_tree(Path(loc), deps / module, suffixes=CARRY_SUFFIXES)
                    for loc in spec.submodule_search_locations)
    elif spec.origin and spec.origin.endswith(".py"):
        shutil.copyfile(spec.origin, deps / f"{module}.py")
        files = 1
    else:
        files = 0
    if not files:
        raise PayloadError(f"verify needs `{module}`; the image lacks it and this host's copy ({spec.origin}) is "
                           "compiled, so it cannot travel", f"install {dist} into the image")
    return Carried(module, dist, version, files)


def _publish_readable(root: Path) -> None:
    """World-readable, so the image's own (non-root) user can read the read-only mount."""
    for folder, _dirs, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


@dataclass
class Payload:
    root: Path
    carried: tuple[Carried, ...] = ()

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def deps(self) -> Path:
        return self.root / "deps"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def stage(missing: tuple[str, ...], *, repo: Path = REPO_ROOT) -> Payload:
    """A fresh temp folder holding src/ (verify, contracts, families) and deps/ (each module of
    `missing`, carried). The caller removes it (Payload.remove)."""
    payload = Payload(Path(tempfile.mkdtemp(prefix="ftimage-audit-")))
    try:
        for part in PROJECT_PACKAGES:
            _copy_tree(repo / part, payload.src / part, suffixes=None)
        payload.deps.mkdir()
        payload.carried = tuple(carry_module(m, payload.deps) for m in missing)
        _publish_readable(payload.root)
    except BaseException:
        payload.remove()
        raise
    return payload
