"""What a kernel cache entry compiled elsewhere must prove before it enters the local cache.

A registry hit (build/remote_cache/) and an imported export (portable.py) are trusted for what
they hold, not for what their meta.json claims: a runner with a bug, or a compromised one, can
sign a meta.json naming one key beside the wheel of another. Everything is checked against the
key's own inputs (`Expected`: the plan's KernelPlan in a build; in an import, meta.json's inputs
once they hash to the key) and is never looser than what a fresh compile passes:

  * meta.json (small, read before the wheel is downloaded, so `--plan` checks it too): its key
    and inputs are the key's; its kernel, version and SASS archs are the inputs'; the wheel it
    names is that kernel's distribution at that version, tagged for the inputs' Python and
    platform (wheel_checks.tag_rows); the torch, CUDA and compiler the compile recorded pass the
    version checks a fresh compile gets (wheel_checks.version_rows).
  * the wheel itself: its SASS per target arch read from its ELF fatbins, none missing and none
    extra (archs.py and wheel_checks.arch_rows, as a fresh compile); its SASS and PTX as
    meta.json records them; its dist-info's tags, name and version those of its file name
    (wheel_checks.dist_info_rows). Its sha256 is meta.json's (portable.prove_entry).

What needs a container (import, C++ ABI, entry points) runs in the image's check stage, for every
kernel wheel in the image, fetched or compiled (build/kernels/__init__.py `check_image`).
"""
from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elftools.common.exceptions import ELFError
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from build.kernels.archs import archs_of_wheel
from build.kernels.wheel_checks import CheckRow, arch_rows, dist_info_rows, tag_rows, version_rows
from build.resolve import KernelPlan, digest

COMPILED = "cuda-extension"
NEEDED = ("kernel", "version", "archs", "python", "platform", "cuda", "compiler")


@dataclass(frozen=True)
class Expected:
    """A kernel key and its own inputs: what its wheel must be. `torch`: the torch version the
    inputs pin (they name the torch wheel by its sha256), None where nothing here knows it (an
    import of an entry whose torch is neither a toolchain of the manifest nor this plan's)."""
    key: str
    inputs: dict[str, Any]
    torch: str | None = None

    @classmethod
    def of(cls, kernel: KernelPlan, toolchain) -> Expected:
        return cls(kernel.key, kernel.key_inputs, toolchain.torch_version)

    @property
    def name(self) -> str:
        return str(self.inputs.get("kernel", "?"))


@dataclass(frozen=True)
class _Versions:
    """The toolchain fields version_rows compares the recorded versions with."""
    torch_version: str
    cuda: str
    compiler: str


def _failed(rows: list[CheckRow]) -> list[str]:
    return [f"{r.check}: {r.detail}" for r in rows if r.status == "FAIL"]


def meta_problems(meta: dict, expected: Expected) -> list[str]:
    """What meta.json (and the wheel file name it gives) gets wrong for `expected`; [] when
    nothing. Needs no wheel: the plan runs it on a registry entry's meta.json alone."""
    inputs = meta.get("inputs")
    if not isinstance(inputs, dict):
        return ["meta.json has no inputs"]
    problems = []
    if meta.get("key") != expected.key:
        problems.append(f"meta.json names key {str(meta.get('key'))[:16]}..., not {expected.key[:16]}...")
    if digest(inputs) != expected.key:
        return problems + [f"the key recomputed from meta.json's inputs is not {expected.key[:16]}...: the inputs "
                           "were edited, or they are another key's"]
    # compared with the key's own inputs from here on: meta.json's hash to the same key
    wanted = expected.inputs
    if wanted.get("kind") != COMPILED:
        return problems + [f"its inputs are of a {str(wanted.get('kind'))[:40]} kernel; only compiled kernels "
                           "are shared between caches (a Triton kernel's pure-Python wheel is built where it is "
                           "needed)"]
    missing = [field for field in NEEDED if not wanted.get(field)]
    if missing:
        return problems + [f"its inputs name no {', '.join(missing)}: not a key a build makes"]
    for field in ("kernel", "version"):
        if meta.get(field) != wanted[field]:
            problems.append(f"meta.json's {field} {str(meta.get(field))[:60]!r} is not its inputs' {wanted[field]!r}")
    archs = meta.get("archs")
    sass = archs.get("sass") if isinstance(archs, dict) else None
    ptx = archs.get("ptx") if isinstance(archs, dict) else None
    if not isinstance(sass, list) or sorted(map(str, sass)) != sorted(wanted["archs"]):
        problems.append(f"meta.json's archs {str(sass)[:80]} are not the archs its inputs asked for "
                        f"{wanted['archs']}")
    if not isinstance(ptx, list) or not all(isinstance(a, str) for a in ptx):
        problems.append("meta.json records no PTX list")
    wheel = str(meta.get("wheel"))
    try:
        dist, version, _build, _tags = parse_wheel_filename(wheel)
    except InvalidWheelFilename:
        return problems + [f"{wheel[:80]} is not a wheel file name"]
    if canonicalize_name(dist) != canonicalize_name(wanted["kernel"]) or str(version) != str(wanted["version"]):
        problems.append(f"{wheel} is not {wanted['kernel']} {wanted['version']}")
    problems += _failed(tag_rows(expected.name, wheel, python=str(wanted["python"]),
                                 platform=str(wanted["platform"])))
    observed = meta.get("observed")
    if not isinstance(observed, dict):
        return problems + ["meta.json records no torch, CUDA or compiler the wheel was built with (observed)"]
    rows = version_rows(expected.name, {k: str(v) for k, v in observed.items()},
                        _Versions(expected.torch or "", str(wanted["cuda"]), str(wanted["compiler"])))
    if expected.torch is None:    # its torch is named by a wheel hash nothing here maps to a version
        rows = [r for r in rows if r.check != "version: torch"]
    return problems + _failed(rows)


def wheel_problems(wheel: Path, meta: dict, expected: Expected) -> list[str]:
    """What the wheel itself holds against `expected` and against what meta.json records of it;
    [] when nothing. The caller proved `wheel` is the file meta.json's sha256 names."""
    archs = tuple(expected.inputs.get("archs") or ())
    try:
        report = archs_of_wheel(wheel)
    except (zipfile.BadZipFile, ELFError, struct.error, ValueError, KeyError, IndexError, OSError, EOFError) as exc:
        return [f"{wheel.name} cannot be read as a wheel of shared objects: {type(exc).__name__}: {str(exc)[:120]}"]
    problems = _failed(arch_rows(expected.name, report, archs))
    recorded = meta.get("archs") if isinstance(meta.get("archs"), dict) else {}
    for kind, held in (("sass", report.sass), ("ptx", report.ptx)):
        said = recorded.get(kind)
        if not isinstance(said, list) or sorted(map(str, said)) != sorted(held):
            problems.append(f"meta.json records {kind.upper()} {str(said)[:80]}, the wheel holds "
                            f"{','.join(held) or 'none'}")
    return problems + _failed(dist_info_rows(expected.name, wheel))


def refusal(problems: list[str]) -> str:
    """One line for a WARN or an import's refusal: the first problems, and how many more."""
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more
