"""The build lock: the single source of truth about what an image holds.

`build/` writes it (JSON, canonical form) to LOCK_PATH inside the image and digests it
into an OCI label. `verify/` and `entrypoint/` only ever read it; they never re-derive
what was built. This module is the one definition of its format, shared by all three.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

LOCK_PATH = Path("/etc/ftimage/build.lock.json")
LOCK_ENV = "FTIMAGE_LOCK"  # overrides LOCK_PATH (tests, or running outside the image)
SCHEMA_VERSION = 1


class LockError(Exception):
    """The lock is missing or unreadable; carries a fix for the user."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True, kw_only=True)
class LockedPackage:
    """One Python distribution installed from the hash-locked wheelhouse."""

    name: str
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True, kw_only=True)
class LockedKernel:
    """One fused-kernel package, with what it must provide and replace at run time."""

    name: str                      # distribution name, e.g. "causal-conv1d"
    version: str
    kind: str                      # "cuda-extension" (compiled) or "triton" (pure Python + JIT)
    import_name: str               # top-level Python package, e.g. "causal_conv1d", "fla"
    key: str                       # content-addressed cache key of the wheel (hex sha256)
    wheel: str                     # wheel filename installed into the image
    sha256: str                    # sha256 of that wheel
    extension_module: str = ""     # compiled module for cuda-extension kernels, e.g. "causal_conv1d_cuda"
    entry_points: tuple[str, ...] = ()  # forward AND backward symbols the module must export
    replaces: tuple[str, ...] = ()      # transformers functions it must back, e.g. "causal_conv1d_fn",
    #                                     "chunk_gated_delta_rule", "attention:flash_attention_2"
    archs: tuple[str, ...] = ()         # SASS archs found in the wheel at build time, e.g. ("sm_90",)


@dataclass(frozen=True, kw_only=True)
class BuildLock:
    schema_version: int = SCHEMA_VERSION
    image: str                     # image spec name, e.g. "smoke"
    plan_key: str                  # content-addressed key of the whole build plan
    python: str                    # "3.11"
    torch: str                     # exact torch version, e.g. "2.13.0+cpu"
    cuda: str                      # toolkit version, e.g. "13.0", or "cpu"
    cxx11_abi: bool
    compiler: str                  # e.g. "gcc-12"
    transformers: str
    model_family: str              # transformers model_type the image targets, e.g. "qwen3_5_text"
    target_archs: tuple[str, ...]  # e.g. ("sm_90", "sm_100"); empty for CPU images
    attn_implementation: str       # attention the image promises, e.g. "flash_attention_2" or "sdpa"
    kernels: tuple[LockedKernel, ...] = ()
    packages: tuple[LockedPackage, ...] = ()
    base_images: dict[str, str] = field(default_factory=dict)  # stage -> image id/digest
    finetune_defaults: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, fixed separators, so equal locks are byte-identical."""
        return json.dumps(asdict(self), sort_keys=True, indent=2, ensure_ascii=True) + "\n"

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildLock":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise LockError(
                f"lock schema_version is {version!r}, this code reads {SCHEMA_VERSION}",
                "rebuild the image with the same checkout of build/ that made verify/",
            )
        try:
            kernels = tuple(_build(LockedKernel, k) for k in data.get("kernels", ()))
            packages = tuple(_build(LockedPackage, p) for p in data.get("packages", ()))
            scalar = {k: v for k, v in data.items() if k not in ("kernels", "packages")}
            scalar["target_archs"] = tuple(scalar.get("target_archs", ()))
            return cls(kernels=kernels, packages=packages, **scalar)
        except TypeError as exc:
            raise LockError(f"lock has an unexpected shape: {exc}", "rebuild the image") from None


def _build(kind: type, data: dict[str, Any]):
    names = {f.name for f in fields(kind)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
    return kind(**values)


def lock_path() -> Path:
    return Path(os.environ.get(LOCK_ENV) or LOCK_PATH)


def load_lock(path: Path | None = None) -> BuildLock:
    path = path or lock_path()
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise LockError(
            f"no build lock at {path}",
            f"run inside an image built by `python -m build`, or set {LOCK_ENV}=/path/to/build.lock.json",
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise LockError(f"cannot read build lock {path}: {exc}", "rebuild the image; the lock is damaged") from None
    if not isinstance(data, dict):
        raise LockError(f"build lock {path} is not a JSON object", "rebuild the image; the lock is damaged")
    return BuildLock.from_dict(data)
