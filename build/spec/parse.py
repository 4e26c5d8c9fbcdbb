"""Stage 1: files -> typed objects. Safe YAML, then the schema engine, then validate.py's
per-file rules. Cross-file compatibility (torch x CUDA, arch x CUDA, kernel ranges, the
model family) is build/resolve's job.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

from build.spec import validate
from build.spec.files import display_path, looks_secret, read_document, secret_scan
from build.spec.shapes import BootstrapBase, ImageSpec, Manifest, ManifestDocument
from contracts.schema import Problems, Reader

__all__ = ["REPO_ROOT", "MANIFEST_PATH", "BASES_DIR", "load_manifest", "load_image_spec", "load_bootstrap_base",
           "display_path", "looks_secret", "read_document", "secret_scan"]

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST_PATH = REPO_ROOT / "kernels_manifest.yaml"
BASES_DIR = REPO_ROOT / "images" / "_bases"


def _set(obj: Any, **values: Any) -> Any:
    """Fill the non-init fields of a frozen spec object (its name from its key, its folder...)."""
    for key, value in values.items():
        object.__setattr__(obj, key, value)
    return obj


def load_manifest(path: Path = MANIFEST_PATH, problems: Problems | None = None) -> Manifest:
    own = problems is None
    problems = Problems() if problems is None else problems
    data = read_document(Path(path), problems, "kernels manifest")
    shown = display_path(path)
    doc = None
    if data is not None:
        reader = Reader(shown, problems, string_check=secret_scan)
        # Read entry by entry, so one broken kernel leaves the others usable (and reported).
        doc = reader.read(ManifestDocument, {**data, "toolchains": {}, "kernels": {}})
        toolchains = _entries(reader, data, "toolchains", ManifestDocument)
        kernels = _entries(reader, data, "kernels", ManifestDocument)
    else:
        toolchains, kernels = {}, {}
    for name, tc in toolchains.items():
        _set(tc, name=name)
    for name, kernel in kernels.items():
        _set(kernel, name=name)
    manifest = Manifest(path=Path(path), toolchains=toolchains, kernels=kernels)
    validate.manifest(manifest, shown, problems, REPO_ROOT)
    broken = frozenset(f"{section}.{name}" for section in ("toolchains", "kernels")
                       for name in (data or {}).get(section, {}) or {}
                       if isinstance(name, str) and problems.touches(shown, f"{section}.{name}"))
    if doc is None and data is not None and not problems:
        problems.add(shown, "(file)", "not a kernels manifest", "see kernels_manifest.yaml for the shape")
    if own:
        problems.raise_if_any(validate.SpecErrors)
    return dataclasses.replace(manifest, broken=broken)


def _entries(reader: Reader, data: dict, section: str, document: type) -> dict:
    """Read `section` (a mapping of name -> entry) entry by entry."""
    raw = data.get(section)
    if raw is None:
        reader.fail(section, "required field is missing", f"add `{section}:` to the top level", "missing-field")
        return {}
    if not isinstance(raw, dict):
        reader.fail(section, f"expected a mapping of name -> entry, got {type(raw).__name__}",
                    f"write {section} as `name: {{...}}` entries", "wrong-type")
        return {}
    entry_type = typing.get_args(typing.get_type_hints(document)[section])[1]
    out = {}
    for name, body in raw.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]+(?:[._-][a-z0-9]+)*", name):
            reader.fail(f"{section}.{name}", f"{name!r} is not a valid name",
                        "use lowercase letters and digits, separated by '.', '_' or '-'", "bad-format")
            continue
        value = reader.value(entry_type, body, f"{section}.{name}")
        if dataclasses.is_dataclass(value):
            out[name] = value
    return out


def load_bootstrap_base(path: Path, problems: Problems) -> BootstrapBase | None:
    spec_file = path / "base.yaml" if path.is_dir() else path
    data = read_document(spec_file, problems, "bootstrap base spec")
    if data is None:
        return None
    base = Reader(display_path(spec_file), problems, string_check=secret_scan).read(BootstrapBase, data)
    return _set(base, path=spec_file.parent) if base else None


def load_image_spec(directory: Path, problems: Problems | None = None) -> ImageSpec | None:
    own = problems is None
    problems = Problems() if problems is None else problems
    directory = Path(directory)
    spec_file = directory / "image.yaml" if directory.is_dir() or not directory.suffix else directory
    directory = spec_file.parent
    shown = display_path(spec_file)
    data = read_document(spec_file, problems, "image spec")
    spec = None
    if data is not None:
        spec = Reader(shown, problems, string_check=secret_scan).read(ImageSpec, data, partial=True)
        if spec is not None:
            _set(spec, directory=directory)
            for stage in ("builder", "runtime"):
                ref = getattr(spec.bases, stage)
                if ref.bootstrap_name:
                    _set(ref, bootstrap=_bootstrap_base(ref.bootstrap_name, f"bases.{stage}.bootstrap", shown,
                                                        problems))
            _set(spec, finetune_defaults=validate.finetune_defaults(spec, shown, problems))
            validate.image(spec, shown, problems)
    if own:
        problems.raise_if_any(validate.SpecErrors)
    return spec


def _bootstrap_base(name: str, field: str, shown: str, problems: Problems) -> BootstrapBase | None:
    base_dir = BASES_DIR / name
    if not (base_dir / "base.yaml").is_file():
        known = sorted(p.name for p in BASES_DIR.iterdir() if (p / "base.yaml").is_file()) \
            if BASES_DIR.is_dir() else []
        problems.add(shown, field, f"no bootstrap base named {name!r}",
                     f"use one of: {', '.join(known) or '(none)'}, or add images/_bases/{name}/base.yaml",
                     "unknown-base")
        return None
    return load_bootstrap_base(base_dir, problems)
