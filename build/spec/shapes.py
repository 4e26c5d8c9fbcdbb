"""The shapes of kernels_manifest.yaml, images/<name>/image.yaml and images/_bases/*/base.yaml,
as typed dataclasses. contracts.schema reads documents into them; the rules here are the
per-field ones (formats, ranges). Rules that relate fields live in validate.py.

Every field is data, never code: names are checked against strict grammars before any of
them can reach a Dockerfile line, a shell command or a path.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from packaging.version import InvalidVersion, Version

from contracts.schema import rule

# Grammars. Anything that reaches a path, a tag or a Dockerfile line matches one of these.
IMAGE_NAME = r"(?=.{1,128}\Z)[a-z0-9]+(?:[._-][a-z0-9]+)*"                     # a Docker repository path component
KERNEL_NAME = r"[a-z0-9]+(?:[._-][a-z0-9]+)*"
ARCH = r"sm_\d{2,3}"
FILENAME = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}"                  # one path component: no '/', no '..'
ENV_NAME = r"[A-Z][A-Z0-9_]{0,63}"
PY_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]{0,99}"
PY_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?::[A-Za-z_][A-Za-z0-9_.]*)?"
USER_NAME = r"[a-z_][a-z0-9_-]{0,30}"
DEB_PACKAGE = r"[a-z0-9][a-z0-9+.-]+"
LABEL_KEY = r"(?=.{1,128}\Z)[a-z0-9]+(?:[.-][a-z0-9]+)*"   # Docker's label-key format: lowercase, no ".." or "--"
# registry/host[:port]/path[:tag]; host may be localhost or contain dots
IMAGE_REF = (r"(?:(?:[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::\d{1,5})?/)?"
             r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
             r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?")
SHA256 = r"[0-9a-f]{64}"
UID_RANGE = (1000, 2 ** 31 - 2)   # Debian's system ids sit below 1000; 2^31-1 is reserved

PLATFORMS = ("linux_x86_64", "linux_aarch64")
Platform = Literal["linux_x86_64", "linux_aarch64"]

def _sha256(value: str):
    if not re.fullmatch(SHA256, value):
        return (f"not a sha256 (64 lowercase hex characters): {value[:70]!r} has {len(value)} characters",
                "paste the full digest from `sha256sum FILE`", "bad-sha256")
    return None


_SHA = rule(check=_sha256, fix="add the sha256 of the exact file (`sha256sum FILE`)")


def _version(value: str):
    try:
        Version(value)
    except InvalidVersion:
        return f"{value!r} is not a version", 'write a PEP 440 version like "2.8.3"'
    return None


def _arch(value: str):
    if not re.fullmatch(ARCH, value):
        return f"{value!r} is not an arch name", 'write archs as "sm_90", "sm_100"', "unknown-arch"
    return None


# ---- kernels_manifest.yaml -------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PinnedFile:
    """A file fetched by URL (or pip) and accepted only if its sha256 matches."""
    filename: str = field(metadata=rule(pattern=FILENAME, pattern_fix="give a bare file name (no '/' or '..')"))
    sha256: str = field(metadata=_SHA)
    url: str = ""


@dataclass(frozen=True, kw_only=True)
class TorchPin:
    version: str = field(metadata=rule(check=_version))
    wheels: dict[Platform, PinnedFile] = field(metadata=rule(
        fix="pin the exact torch wheel per platform: filename and sha256"))


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    python: str = field(metadata=rule(pattern=r"3\.\d{1,2}", pattern_fix='write a CPython minor version, e.g. "3.11"'))
    torch: TorchPin
    cuda: str = field(metadata=rule(pattern=r"cpu|\d{1,2}\.\d", pattern_fix='write cuda: "13.0" or cuda: cpu',
                                    fix='set cuda: "13.0" (toolkit version) or cuda: cpu'))
    cxx11_abi: bool
    compiler: str = field(metadata=rule(pattern=r"(gcc|clang)-\d{1,2}", pattern_fix='write e.g. "gcc-12"'))
    cuda_pip_toolchain: tuple[str, ...] = ()
    name: str = field(init=False, default="")     # its key in `toolchains:`

    @property
    def torch_version(self) -> str:
        return self.torch.version

    @property
    def torch_wheels(self) -> dict[str, PinnedFile]:
        return self.torch.wheels

    @property
    def is_cpu(self) -> bool:
        return self.cuda == "cpu"


@dataclass(frozen=True, kw_only=True)
class KernelSource:
    sdist: PinnedFile | None = None
    wheels: tuple[PinnedFile, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ArchKnob:
    env: str = field(metadata=rule(pattern=ENV_NAME))
    format: str = field(metadata=rule(pattern=r"\{major\}\.?\{minor\}", pattern_fix=(
        'use "{major}{minor}" (-> 90) or "{major}.{minor}" (-> 9.0)')))
    separator: Literal[";", ",", " "]

    def render(self, archs: tuple[str, ...]) -> str:
        values = []
        for arch in archs:
            digits = arch.removeprefix("sm_")
            values.append(self.format.format(major=digits[:-1], minor=digits[-1]))
        return self.separator.join(values)


@dataclass(frozen=True, kw_only=True)
class SourcePatch:
    path: str = field(metadata=rule(pattern=r"build/patches/" + FILENAME,
                                    pattern_fix="keep patches in build/patches/ and give that relative path"))
    sha256: str = field(metadata=_SHA)
    reason: str = field(metadata=rule(fix="say why the patch is needed"))
    when_torch: str = ""  # a specifier; empty = always


@dataclass(frozen=True, kw_only=True)
class KernelConstraints:
    python: str = ""
    torch: str = ""
    cuda: str = ""
    archs: tuple[str, ...] = field(default=(), metadata=rule(each=_arch))


@dataclass(frozen=True, kw_only=True)
class EntryPoints:
    forward: tuple[str, ...] = field(metadata=rule(each=lambda v: None if re.fullmatch(PY_DOTTED, v) else (
        f"{v!r} is not a symbol name", "write module symbols or module:Class.method")))
    backward: tuple[str, ...] = field(metadata=rule(each=lambda v: None if re.fullmatch(PY_DOTTED, v) else (
        f"{v!r} is not a symbol name", "write module symbols or module:Class.method")))
    other: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ProfileKernels:
    """GPU kernel-name patterns a profiler sees when the fused path runs (verify checks them)."""
    forward: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SpecialiseAxis:
    env: str = field(metadata=rule(pattern=ENV_NAME))
    supported: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class SpecialiseDisable:
    env: str = field(metadata=rule(pattern=ENV_NAME))
    features: dict[str, str]   # family feature -> the value our patch maps to a DISABLE define


@dataclass(frozen=True, kw_only=True)
class Specialise:
    """How a kernel can be trimmed to one model family (knobs our pinned patches add). A kernel
    declares the axes it has: flash-attn head dims, dtypes and features; causal-conv1d dtypes."""
    dtypes: SpecialiseAxis
    head_dims: SpecialiseAxis | None = None
    disable: SpecialiseDisable | None = None
    separator: Literal[";", ","] = ";"
    sources_per_combination: int = field(default=0, metadata=rule(ge=0, le=1000))  # sources per (head dim,
    #                                dtype); 0: the source count does not change, only what each compiles
    extra_sources: int = field(default=0, metadata=rule(ge=0, le=1000))   # always compiled (flash_api.cpp)
    serves: tuple[str, ...] = ()   # attention implementations a specialised build serves (empty: any)


@dataclass(frozen=True, kw_only=True)
class RuntimeConstraintSpec:
    """A package version the kernel needs at run time, on some archs (checked at build time
    against the image's pins, and by verify against what is installed)."""
    package: str = field(metadata=rule(pattern=r"[a-z0-9][a-z0-9._-]*"))
    version: str
    archs: tuple[str, ...] = field(default=(), metadata=rule(each=_arch))
    reason: str = field(metadata=rule(fix="say why, with the upstream issue"))


@dataclass(frozen=True, kw_only=True)
class CompileCost:
    """Measured compile cost on this project's 2-core machine, per target arch (for --plan)."""
    sources: int = field(metadata=rule(ge=1, le=10000))
    cpu_seconds_per_source: float = field(metadata=rule(ge=0.1, le=36000))
    cpu_seconds_per_source_specialised: float = field(default=0.0, metadata=rule(ge=0, le=36000))


@dataclass(frozen=True, kw_only=True)
class Kernel:
    version: str = field(metadata=rule(check=_version))
    kind: Literal["cuda-extension", "triton"]
    import_name: str = field(metadata=rule(pattern=PY_IDENTIFIER))
    extension_module: str = field(default="", metadata=rule(pattern=r"|" + PY_IDENTIFIER))
    source: KernelSource = field(metadata=rule(
        fix="give source.sdist (url, filename, sha256) or source.wheels (explicit prebuilt pins)"))
    build_env: dict[str, str] = field(default_factory=dict)
    arch_knob: ArchKnob | None = None
    patches: tuple[SourcePatch, ...] = ()
    constraints: KernelConstraints = field(metadata=rule(
        fix="give python, torch, cuda specifier ranges and the archs the kernel supports"))
    entry_points: EntryPoints = field(metadata=rule(
        fix="list the forward and backward symbols the built module must export"))
    replaces: tuple[str, ...]
    python_api: dict[str, str] = field(default_factory=dict)   # replaced function -> fused symbol
    profile_kernels: ProfileKernels = field(default_factory=ProfileKernels)
    runtime_requires: tuple[str, ...] = ()
    build_requires: tuple[str, ...] = ()
    memory_per_job_gb: float = field(default=4.0, metadata=rule(ge=0.25, le=256, fix=(
        "give the peak memory of one compile job in GB, e.g. 4")))
    specialise: Specialise | None = None
    compile_cost: CompileCost | None = None
    runtime_constraints: tuple[RuntimeConstraintSpec, ...] = ()
    name: str = field(init=False, default="")     # its key in `kernels:`

    @property
    def sdist(self) -> PinnedFile | None:
        return self.source.sdist

    @property
    def wheels(self) -> tuple[PinnedFile, ...]:
        return self.source.wheels

    @property
    def forward_entry_points(self) -> tuple[str, ...]:
        return self.entry_points.forward

    @property
    def backward_entry_points(self) -> tuple[str, ...]:
        return self.entry_points.backward

    @property
    def other_entry_points(self) -> tuple[str, ...]:
        return self.entry_points.other


@dataclass(frozen=True, kw_only=True)
class ManifestDocument:
    schema_version: Literal[1]
    toolchains: dict[str, Toolchain]
    kernels: dict[str, Kernel]


@dataclass(frozen=True)
class Manifest:
    path: Path
    toolchains: dict[str, Toolchain]
    kernels: dict[str, Kernel]
    broken: frozenset[str] = frozenset()   # "toolchains.X" / "kernels.Y" entries with problems already reported


# ---- images/_bases/<name>/base.yaml ----------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class BootstrapBase:
    """A Debian base built locally with debootstrap, written as an image by this tool and loaded (no registry)."""
    name: str = field(metadata=rule(pattern=IMAGE_NAME, pattern_fix="use lowercase letters, digits, '.', '_', '-'"))
    suite: str = field(metadata=rule(pattern=r"[a-z]{2,20}", pattern_fix="name a Debian suite, e.g. bookworm"))
    variant: Literal["minbase", "buildd"] = "minbase"
    mirror: str = field(default="http://deb.debian.org/debian", metadata=rule(
        pattern=r"https?://[A-Za-z0-9.-]+(?::\d{1,5})?(?:/[A-Za-z0-9._~-]+)*/?",
        pattern_fix="give the mirror's http(s) URL, e.g. http://deb.debian.org/debian"))
    packages: tuple[str, ...] = field(metadata=rule(each=lambda p: None if re.fullmatch(DEB_PACKAGE, p) else (
        f"{p!r} is not a Debian package name", "use the package name as apt knows it")))
    path: Path = field(init=False, default=Path("."))

    def spec_dict(self) -> dict[str, Any]:
        spec = {"name": self.name, "suite": self.suite, "variant": self.variant, "mirror": self.mirror,
                "packages": sorted(self.packages)}
        lock = self.path / "debs.lock.json"
        if lock.is_file():   # a re-pinned lock is a new base
            spec["debs_lock_sha256"] = hashlib.sha256(lock.read_bytes()).hexdigest()
        return spec


# ---- images/<name>/image.yaml ------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class BaseRef:
    """Where a build stage starts: a bootstrapped base, or a registry image (tag, optional digest)."""
    bootstrap_name: str = field(default="", metadata=rule(key="bootstrap", pattern=IMAGE_NAME,
                                                          pattern_fix="name a folder under images/_bases/"))
    image: str = field(default="", metadata=rule(pattern=IMAGE_REF, pattern_fix=(
        "write a Docker reference: [registry/]repo:tag (lowercase repository)")))
    digest: str = field(default="", metadata=rule(pattern=r"sha256:" + SHA256, pattern_fix=(
        "use the full sha256:<64 hex> digest from `docker inspect --format '{{.RepoDigests}}'`")))
    bootstrap: BootstrapBase | None = field(init=False, default=None)

    def describe(self) -> str:
        if self.bootstrap_name:
            return f"bootstrap:{self.bootstrap_name}"
        return f"{self.image}@{self.digest}" if self.digest else self.image


@dataclass(frozen=True, kw_only=True)
class Bases:
    builder: BaseRef = field(metadata=rule(fix="add bases.builder: {bootstrap: debian-bookworm} or "
                                               "{image: TAG, digest: sha256:...}"))
    runtime: BaseRef = field(metadata=rule(fix="add bases.runtime: {bootstrap: debian-bookworm} or "
                                               "{image: TAG, digest: sha256:...}"))


@dataclass(frozen=True, kw_only=True)
class PythonSection:
    requirements: tuple[str, ...] = ()


def _gid(value: int):
    # 0 means "not set: use the uid"; anything else must avoid Debian's system groups (< 1000)
    if value != 0 and not UID_RANGE[0] <= value <= UID_RANGE[1]:
        return (f"gid {value} is outside {UID_RANGE[0]}..{UID_RANGE[1]} (Debian's system groups sit below "
                f"{UID_RANGE[0]})", f"use a gid in {UID_RANGE[0]}..{UID_RANGE[1]}, or leave it out to use the uid")
    return None


@dataclass(frozen=True, kw_only=True)
class RuntimeSection:
    user: str = field(metadata=rule(pattern=USER_NAME, pattern_fix="use lowercase letters, digits, '_' or '-'"))
    uid: int = field(metadata=rule(ge=UID_RANGE[0], le=UID_RANGE[1], fix=(
        f"use a fixed non-root uid in {UID_RANGE[0]}..{UID_RANGE[1]}, e.g. 10001")))
    gid: int = field(default=0, metadata=rule(check=_gid, fix=(
        f"use a gid in {UID_RANGE[0]}..{UID_RANGE[1]}, or leave it out to use the uid")))
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"

    @property
    def name(self) -> str:
        return self.user


@dataclass(frozen=True, kw_only=True)
class FinetuneSection:
    defaults: dict[str, Any] = field(default_factory=dict)
    config_file: str = ""    # relative to the image folder; checked to stay inside it (validate.py)


@dataclass(frozen=True, kw_only=True)
class ImageSpec:
    name: str = field(metadata=rule(pattern=IMAGE_NAME, pattern_fix=(
        "use lowercase letters and digits, separated by single '.', '_' or '-'")))
    description: str = ""
    toolchain: str = field(metadata=rule(fix="name a toolchain from kernels_manifest.yaml"))
    platform: Platform = "linux_x86_64"
    bases: Bases
    target_archs: tuple[str, ...] = field(default=(), metadata=rule(each=_arch))
    kernels: tuple[str, ...] = ()
    specialise_kernels: bool = True    # trim kernels to the model family's needs (false: generic build)
    python: PythonSection = field(default_factory=PythonSection)
    runtime: RuntimeSection = field(metadata=rule(fix="add runtime: {user: trainer, uid: 10001}"))
    labels: dict[str, str] = field(default_factory=dict)
    # the one-family form; an image for several families lists them in model_families instead
    model_family: str = ""
    model_families: tuple[str, ...] = ()
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    directory: Path = field(init=False, default=Path("."))
    finetune_defaults: dict[str, Any] = field(init=False, default_factory=dict)

    @property
    def families(self) -> tuple[str, ...]:
        """The model families the image trains, in the order image.yaml lists them."""
        return self.model_families or ((self.model_family,) if self.model_family else ())

    @property
    def builder_base(self) -> BaseRef:
        return self.bases.builder

    @property
    def runtime_base(self) -> BaseRef:
        return self.bases.runtime

    @property
    def python_requirements(self) -> tuple[str, ...]:
        return self.python.requirements

    @property
    def user(self) -> RuntimeSection:
        return self.runtime

    @property
    def gid(self) -> int:
        return self.runtime.gid or self.runtime.uid

    @property
    def attn_implementation(self) -> str:
        return self.runtime.attn_implementation
