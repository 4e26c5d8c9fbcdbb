"""The build lock: the single source of truth about what an image holds.

build/ writes it (canonical JSON) to LOCK_PATH inside the image and digests it into an OCI
label. verify/ and entrypoint/ only ever read it; they never re-derive what was built.
This module is the one definition of its format.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from contracts.errors import FixableError

LOCK_PATH = Path("/etc/ftimage/build.lock.json")
LOCK_ENV = "FTIMAGE_LOCK"  # overrides LOCK_PATH (tests, or running outside the image)
SCHEMA_VERSION = 2


class LockError(FixableError):
    """The lock is missing or unreadable; carries a fix for the user."""

    exit_code = 1   # entrypoint/cli.py `info`; verify shows it as a FAIL row instead

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


@dataclass(frozen=True, kw_only=True)
class LockedPackage:
    """One Python distribution installed from the hash-locked wheelhouse."""

    name: str
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Specialisation:
    """What a compiled kernel was trimmed to (empty = the generic build).

    A kernel built for one model family holds only the head dims and dtypes that family
    uses, with some features compiled out; a model outside this is refused before it runs.
    """

    head_dims: tuple[int, ...] = ()      # compiled head dims; empty = all the kernel supports
    dtypes: tuple[str, ...] = ()         # compiled dtypes ("bf16", "fp16"); empty = all
    disabled: tuple[str, ...] = ()       # features compiled out: dropout, alibi, softcap, sliding_window, ...
    family: str = ""                     # the model family it was derived from

    @property
    def generic(self) -> bool:
        return not (self.head_dims or self.dtypes or self.disabled)


@dataclass(frozen=True, kw_only=True)
class RuntimeConstraint:
    """A package version a kernel needs at run time, on some archs (e.g. fla's Triton on Hopper)."""

    package: str                   # distribution, e.g. "triton"
    version: str                   # PEP 440 specifier, e.g. ">=3.7.1"
    archs: tuple[str, ...] = ()    # where it applies; empty = everywhere
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class LockedKernel:
    """One installed wheel of a fused-kernel package, with what it must provide at run time.

    A kernel can ship as several wheels (flash-linear-attention + fla-core); each gets its own
    entry, named by its own distribution, so verify checks every installed file of each.
    """

    name: str                      # the manifest's kernel name, e.g. "flash-linear-attention"
    distribution: str              # this wheel's distribution, e.g. "fla-core"
    version: str                   # this distribution's version
    kind: str                      # "cuda-extension" (compiled) or "triton" (pure Python + JIT)
    import_name: str               # top-level Python package, e.g. "causal_conv1d", "fla"
    key: str                       # content-addressed cache key of the kernel build (hex sha256)
    wheel: str                     # wheel filename installed into the image
    sha256: str                    # sha256 of that wheel
    extension_module: str = ""     # compiled module for cuda-extension kernels, e.g. "causal_conv1d_cuda"
    entry_points: tuple[str, ...] = ()   # forward AND backward symbols the module must export
    replaces: tuple[str, ...] = ()       # transformers functions it backs, e.g. "causal_conv1d_fn",
    #                                      or an attention implementation "attention:flash_attention_2"
    python_api: dict[str, str] = field(default_factory=dict)  # replaced function -> fused symbol
    profile_kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)  # forward/backward GPU
    #                                      kernel-name patterns a profiler must see when it runs
    archs: tuple[str, ...] = ()          # SASS archs found in the wheel at build time, e.g. ("sm_90",)
    specialisation: Specialisation = field(default_factory=Specialisation)
    runtime_constraints: tuple[RuntimeConstraint, ...] = ()


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
    # how the build was made, where that bears on trusting it; written only when not empty, so
    # a lock without it is byte-identical to one from before it existed. Today only
    # {"remote_cache_trust": "unsigned"}: remote cache entries were used without a verified
    # signature (`--trust-unsigned-cache`).
    build: dict[str, str] = field(default_factory=dict)
    # every family of an image built for several (model_family is then the first); written only
    # when set, so a one-family lock is byte-identical to one from before it existed
    model_families: tuple[str, ...] = ()

    @property
    def families(self) -> tuple[str, ...]:
        """The model families the image was built and proven for."""
        return self.model_families or (self.model_family,)

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, fixed separators, so equal locks are byte-identical."""
        data = asdict(self)
        for optional in ("build", "model_families"):
            if not data[optional]:
                del data[optional]
        return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=True) + "\n"

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def kernels_replacing(self, function: str) -> tuple[LockedKernel, ...]:
        return tuple(k for k in self.kernels if function in k.replaces)

    def specialisation_for(self, function: str) -> Specialisation | None:
        """The specialisation of the kernel that backs `function`, if any kernel does."""
        for kernel in self.kernels_replacing(function):
            return kernel.specialisation
        return None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildLock:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise LockError(
                f"lock schema_version is {version!r}, this code reads {SCHEMA_VERSION}",
                "rebuild the image with the same checkout of build/ that made verify/",
            )
        try:
            kernels = tuple(_kernel(k) for k in data.get("kernels", ()))
            packages = tuple(_build(LockedPackage, p) for p in data.get("packages", ()))
            scalar = {k: v for k, v in data.items() if k not in ("kernels", "packages")}
            scalar["target_archs"] = tuple(scalar.get("target_archs", ()))
            scalar["model_families"] = tuple(scalar.get("model_families", ()))
            return cls(kernels=kernels, packages=packages, **scalar)
        except (TypeError, AttributeError) as exc:
            raise LockError(f"lock has an unexpected shape: {exc}", "rebuild the image") from None


def _kernel(data: dict[str, Any]) -> LockedKernel:
    values = dict(data)
    values["specialisation"] = _build(Specialisation, values.get("specialisation") or {})
    values["profile_kernels"] = {k: tuple(v) for k, v in (values.get("profile_kernels") or {}).items()}
    values["runtime_constraints"] = tuple(_build(RuntimeConstraint, c) for c in values.get("runtime_constraints") or ())
    return _build(LockedKernel, values)


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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LockError(f"cannot read build lock {path}: {exc}", "rebuild the image; the lock is damaged") from None
    if not isinstance(data, dict):
        raise LockError(f"build lock {path} is not a JSON object", "rebuild the image; the lock is damaged")
    return BuildLock.from_dict(data)
