"""Typed, validated spec: kernels_manifest.yaml + images/<name>/image.yaml (+ bootstrap bases).

Loading only checks each file on its own terms (shapes, types, digests, paths).
Cross-file compatibility (torch x CUDA, arch x CUDA, kernel ranges) is build/resolve's job.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from build.errors import Problems
from build.fields import Fields, display_path, load_yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST_PATH = REPO_ROOT / "kernels_manifest.yaml"
BASES_DIR = REPO_ROOT / "images" / "_bases"
KERNEL_KINDS = ("cuda-extension", "triton")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
ARCH_RE = re.compile(r"^sm_(\d+)$")
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
PLATFORMS = ("linux_x86_64", "linux_aarch64")


# ---- manifest ------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PinnedFile:
    """A file fetched by URL (or pip) and accepted only if its sha256 matches."""
    filename: str
    sha256: str
    url: str = ""


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    name: str
    python: str                        # "3.11"
    torch_version: str                 # "2.14.1" or "2.13.0+cpu"
    torch_wheels: dict[str, PinnedFile]  # platform -> exact wheel
    cuda: str                          # "13.0" or "cpu"
    cxx11_abi: bool
    compiler: str
    cuda_pip_toolchain: tuple[str, ...] = ()

    @property
    def is_cpu(self) -> bool:
        return self.cuda == "cpu"


@dataclass(frozen=True, kw_only=True)
class SourcePatch:
    path: str          # repo-relative
    sha256: str
    reason: str
    when_torch: str = ""  # specifier; empty = always


@dataclass(frozen=True, kw_only=True)
class ArchKnob:
    env: str
    format: str        # "{major}{minor}" -> "90"; "{major}.{minor}" -> "9.0"
    separator: str

    def render(self, archs: tuple[str, ...]) -> str:
        values = []
        for arch in archs:
            digits = ARCH_RE.match(arch).group(1)
            values.append(self.format.format(major=digits[:-1], minor=digits[-1]))
        return self.separator.join(values)


@dataclass(frozen=True, kw_only=True)
class KernelConstraints:
    python: str = ""
    torch: str = ""
    cuda: str = ""
    archs: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Kernel:
    name: str
    version: str
    kind: str
    import_name: str
    extension_module: str = ""
    sdist: PinnedFile | None = None
    wheels: tuple[PinnedFile, ...] = ()
    build_env: dict[str, str] = field(default_factory=dict)
    arch_knob: ArchKnob | None = None
    patches: tuple[SourcePatch, ...] = ()
    constraints: KernelConstraints = KernelConstraints()
    forward_entry_points: tuple[str, ...] = ()
    backward_entry_points: tuple[str, ...] = ()
    other_entry_points: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()
    runtime_requires: tuple[str, ...] = ()
    build_requires: tuple[str, ...] = ()
    memory_per_job_gb: float = 4.0  # peak RSS of one compile job; sizes MAX_JOBS


@dataclass(frozen=True, kw_only=True)
class Manifest:
    path: Path
    toolchains: dict[str, Toolchain]
    kernels: dict[str, Kernel]


def load_manifest(path: Path = MANIFEST_PATH, problems: Problems | None = None) -> Manifest:
    own = problems is None
    problems = Problems() if problems is None else problems
    data = load_yaml(path, problems, "kernels manifest")
    f = Fields(display_path(path), problems)
    toolchains: dict[str, Toolchain] = {}
    kernels: dict[str, Kernel] = {}
    if data is not None:
        f.unknown_keys(data, "", {"schema_version", "toolchains", "kernels"})
        if f.get(data, "schema_version", "", int) not in (None, 1):
            f.fail("schema_version", f"unsupported schema_version {data['schema_version']!r}", "use 1")
        for name, body in (f.get(data, "toolchains", "", dict, default={}) or {}).items():
            tc = _load_toolchain(f, str(name), body)
            if tc:
                toolchains[tc.name] = tc
        for name, body in (f.get(data, "kernels", "", dict, default={}) or {}).items():
            kernel = _load_kernel(f, str(name), body)
            if kernel:
                kernels[kernel.name] = kernel
    if own:
        problems.raise_if_any()
    return Manifest(path=path, toolchains=toolchains, kernels=kernels)


def _load_toolchain(f: Fields, name: str, body: Any) -> Toolchain | None:
    where = f"toolchains.{name}"
    if not isinstance(body, dict):
        f.fail(where, "expected a mapping", "give python, torch, cuda, cxx11_abi and compiler", "wrong-type")
        return None
    f.unknown_keys(body, where, {"python", "torch", "cuda", "cxx11_abi", "compiler", "cuda_pip_toolchain"})
    python = f.get(body, "python", where, str)
    if python and not re.match(r"^3\.\d+$", python):
        f.fail(f"{where}.python", f"expected a CPython minor version like \"3.11\", got {python!r}",
               'write e.g. python: "3.11"')
    torch = f.get(body, "torch", where, dict, default={})
    torch_version = f.get(torch, "version", f"{where}.torch", str)
    wheels: dict[str, PinnedFile] = {}
    for platform, wheel in (f.get(torch, "wheels", f"{where}.torch", dict, default={}) or {}).items():
        wfield = f"{where}.torch.wheels.{platform}"
        if platform not in PLATFORMS:
            f.fail(wfield, f"unknown platform {platform!r}", f"use one of: {', '.join(PLATFORMS)}", "unknown-platform")
            continue
        pinned = _load_pinned(f, wheel, wfield, need_url=False)
        if pinned:
            wheels[platform] = pinned
    cuda = f.get(body, "cuda", where, str, fix='set cuda: "13.0" (toolkit version) or cuda: cpu')
    if cuda and cuda != "cpu" and not re.match(r"^\d+\.\d+$", cuda):
        f.fail(f"{where}.cuda", f"expected a CUDA version like \"13.0\" or cpu, got {cuda!r}", 'write cuda: "13.0"')
    abi = f.get(body, "cxx11_abi", where, bool)
    compiler = f.get(body, "compiler", where, str)
    pip_toolchain = f.str_list(body, "cuda_pip_toolchain", where, required=False)
    for i, req in enumerate(pip_toolchain):
        _check_pinned_requirement(f, req, f"{where}.cuda_pip_toolchain[{i}]")
    if None in (python, torch_version, cuda, abi, compiler) or not wheels:
        if torch and not wheels and "wheels" in torch:
            pass
        elif torch and "wheels" not in torch:
            f.fail(f"{where}.torch.wheels", "required field is missing",
                   "pin the exact torch wheel per platform: filename and sha256", "missing-field")
        return None
    return Toolchain(name=name, python=python, torch_version=torch_version, torch_wheels=wheels, cuda=cuda,
                     cxx11_abi=abi, compiler=compiler, cuda_pip_toolchain=pip_toolchain)


def _load_pinned(f: Fields, body: Any, where: str, *, need_url: bool) -> PinnedFile | None:
    if not isinstance(body, dict):
        f.fail(where, "expected a mapping with filename and sha256", "give filename: and sha256:", "wrong-type")
        return None
    f.unknown_keys(body, where, {"filename", "sha256", "url"})
    filename = f.get(body, "filename", where, str)
    sha = f.sha256(body, "sha256", where)
    url = f.get(body, "url", where, str, required=need_url,
                fix="give the exact https://files.pythonhosted.org/... URL of the file", default="")
    if url and not url.startswith("https://"):
        f.fail(f"{where}.url", f"only https URLs are accepted, got {url[:40]!r}", "use the https:// URL")
        return None
    if url and filename and not url.endswith("/" + filename):
        f.fail(f"{where}.url", f"URL does not end in the pinned filename {filename!r}",
               "make filename match the last part of the URL")
        return None
    if filename is None or sha is None:
        return None
    return PinnedFile(filename=filename, sha256=sha, url=url)


def _load_kernel(f: Fields, name: str, body: Any) -> Kernel | None:
    where = f"kernels.{name}"
    if not isinstance(body, dict):
        f.fail(where, "expected a mapping", "see kernels_manifest.yaml for the shape of a kernel entry", "wrong-type")
        return None
    f.unknown_keys(body, where, {"version", "kind", "import_name", "extension_module", "source", "build_env",
                                 "arch_knob", "patches", "constraints", "entry_points", "replaces",
                                 "runtime_requires", "build_requires", "memory_per_job_gb"})
    version = f.get(body, "version", where, str)
    kind = f.get(body, "kind", where, str)
    if kind and kind not in KERNEL_KINDS:
        f.fail(f"{where}.kind", f"unknown kernel kind {kind!r}", f"use one of: {', '.join(KERNEL_KINDS)}")
        kind = None
    import_name = f.get(body, "import_name", where, str)
    extension_module = f.get(body, "extension_module", where, str, required=(kind == "cuda-extension"),
                             default="", fix="name the compiled module, e.g. causal_conv1d_cuda")
    sdist, wheels = _load_source(f, body, where, kind)
    build_env = f.str_map(body, "build_env", where)
    arch_knob = None
    knob = f.get(body, "arch_knob", where, dict, required=(kind == "cuda-extension"),
                 fix="name the env var the package's setup.py really reads for archs (see DESIGN.md)")
    if knob:
        f.unknown_keys(knob, f"{where}.arch_knob", {"env", "format", "separator"})
        env = f.get(knob, "env", f"{where}.arch_knob", str)
        fmt = f.get(knob, "format", f"{where}.arch_knob", str)
        sep = f.get(knob, "separator", f"{where}.arch_knob", str)
        if fmt and ("{major}" not in fmt or "{minor}" not in fmt):
            f.fail(f"{where}.arch_knob.format", f"format {fmt!r} lacks {{major}} or {{minor}}",
                   'use e.g. "{major}{minor}" (-> 90) or "{major}.{minor}" (-> 9.0)')
        elif env and fmt and sep is not None:
            arch_knob = ArchKnob(env=env, format=fmt, separator=sep)
    patches = []
    for i, patch in enumerate(f.get(body, "patches", where, list, required=False, default=[])):
        pw = f"{where}.patches[{i}]"
        if not isinstance(patch, dict):
            f.fail(pw, "expected a mapping with path, sha256 and reason", "give path:, sha256: and reason:",
                   "wrong-type")
            continue
        f.unknown_keys(patch, pw, {"path", "sha256", "reason", "when_torch"})
        path = f.get(patch, "path", pw, str)
        sha = f.sha256(patch, "sha256", pw)
        reason = f.get(patch, "reason", pw, str, fix="say why the patch is needed")
        when = f.get(patch, "when_torch", pw, str, required=False, default="")
        if when:
            _check_specifier(f, when, f"{pw}.when_torch")
        if path:
            _check_inside(f, REPO_ROOT, path, f"{pw}.path", "the repository")
        if path and sha and reason is not None:
            patches.append(SourcePatch(path=path, sha256=sha, reason=reason, when_torch=when))
    constraints = _load_constraints(f, body, where)
    entry = f.get(body, "entry_points", where, dict, default={},
                  fix="list the forward and backward symbols the built module must export")
    forward = f.str_list(entry, "forward", f"{where}.entry_points") if entry else ()
    backward = f.str_list(entry, "backward", f"{where}.entry_points") if entry else ()
    other = f.str_list(entry, "other", f"{where}.entry_points", required=False) if entry else ()
    replaces = f.str_list(body, "replaces", where)
    runtime_requires = f.str_list(body, "runtime_requires", where, required=False)
    for i, req in enumerate(runtime_requires):
        _check_pinned_requirement(f, req, f"{where}.runtime_requires[{i}]")
    build_requires = f.str_list(body, "build_requires", where, required=False)
    memory_per_job = f.get(body, "memory_per_job_gb", where, (int, float), required=False, default=4.0)
    if isinstance(memory_per_job, bool) or not 0.25 <= float(memory_per_job) <= 256:
        f.fail(f"{where}.memory_per_job_gb", f"{memory_per_job!r} is not a plausible GB figure",
               "give the peak memory of one compile job in GB, e.g. 4")
        memory_per_job = 4.0
    for i, req in enumerate(build_requires):
        _check_pinned_requirement(f, req, f"{where}.build_requires[{i}]")
    if None in (version, kind, import_name, extension_module, constraints) or (sdist is None and not wheels):
        return None
    return Kernel(name=name, version=version, kind=kind, import_name=import_name, extension_module=extension_module,
                  sdist=sdist, wheels=wheels, build_env=build_env, arch_knob=arch_knob, patches=tuple(patches),
                  constraints=constraints, forward_entry_points=forward, backward_entry_points=backward,
                  other_entry_points=other, replaces=replaces, runtime_requires=runtime_requires,
                  build_requires=build_requires, memory_per_job_gb=float(memory_per_job))


def _load_source(f: Fields, body: dict, where: str, kind: str | None):
    source = f.get(body, "source", where, dict, default={},
                   fix="give source.sdist (url, filename, sha256) or source.wheels (explicit prebuilt pins)")
    if not source:
        return None, ()
    f.unknown_keys(source, f"{where}.source", {"sdist", "wheels"})
    if "sdist" in source and "wheels" in source:
        f.fail(f"{where}.source", "both sdist and wheels given", "pin exactly one source: an sdist or prebuilt wheels")
        return None, ()
    if "sdist" in source:
        return _load_pinned(f, source["sdist"], f"{where}.source.sdist", need_url=True), ()
    if "wheels" in source:
        if kind == "cuda-extension":
            f.fail(f"{where}.source.wheels", "a compiled kernel must be built from its sdist here",
                   "pin source.sdist; prebuilt CUDA wheels are how ABI mismatches get in (flash-attention #931)",
                   "prebuilt-cuda")
            return None, ()
        wheels = [_load_pinned(f, w, f"{where}.source.wheels[{i}]", need_url=True)
                  for i, w in enumerate(f.get(source, "wheels", f"{where}.source", list, default=[]))]
        return None, tuple(w for w in wheels if w)
    f.fail(f"{where}.source", "no source given", "pin source.sdist (url, filename, sha256) or source.wheels",
           "missing-field")
    return None, ()


def _load_constraints(f: Fields, body: dict, where: str) -> KernelConstraints | None:
    c = f.get(body, "constraints", where, dict, default=None,
              fix="give python, torch, cuda specifier ranges and the archs the kernel supports")
    if c is None:
        return None
    cw = f"{where}.constraints"
    f.unknown_keys(c, cw, {"python", "torch", "cuda", "archs"})
    values = {}
    for key in ("python", "torch", "cuda"):
        spec = f.get(c, key, cw, str, required=False, default="")
        if spec:
            _check_specifier(f, spec, f"{cw}.{key}")
        values[key] = spec
    archs = f.str_list(c, "archs", cw)
    for i, arch in enumerate(archs):
        if not ARCH_RE.match(arch):
            f.fail(f"{cw}.archs[{i}]", f"{arch!r} is not an arch name", 'write archs as "sm_90"', "unknown-arch")
    return KernelConstraints(archs=archs, **values)


def _check_specifier(f: Fields, spec: str, where: str) -> None:
    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        f.fail(where, f"not a version range: {spec!r}", 'write a PEP 440 range like ">=2.4,<3"', "bad-specifier")


def _check_pinned_requirement(f: Fields, req: str, where: str) -> Requirement | None:
    try:
        parsed = Requirement(req)
    except InvalidRequirement as exc:
        f.fail(where, f"not a valid requirement: {req!r} ({exc})", 'write it as "name==1.2.3"', "bad-requirement")
        return None
    pins = [s for s in parsed.specifier if s.operator in ("==", "===") and "*" not in s.version]
    if len(pins) != 1 or parsed.url:
        f.fail(where, f"{req!r} is not pinned to one exact version",
               f'pin it: "{parsed.name}==X.Y.Z" (the lock then holds its sha256)', "unpinned")
        return None
    return parsed


def _check_inside(f: Fields, root: Path, rel: str, where: str, what: str) -> Path | None:
    candidate = (root / rel).resolve()
    if Path(rel).is_absolute() or not candidate.is_relative_to(root.resolve()):
        f.fail(where, f"path {rel!r} points outside {what}", f"keep the file inside {what} and use a relative path",
               "path-outside")
        return None
    if not candidate.is_file():
        f.fail(where, f"file {rel!r} does not exist", f"create it, or fix the path (relative to {what})",
               "missing-file")
        return None
    return candidate



# ---- bootstrap bases -----------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class BootstrapBase:
    """A Debian base built locally with debootstrap and `docker import` (no registry)."""
    name: str
    path: Path
    suite: str
    variant: str
    mirror: str
    packages: tuple[str, ...]

    def spec_dict(self) -> dict[str, Any]:
        return {"name": self.name, "suite": self.suite, "variant": self.variant, "mirror": self.mirror,
                "packages": sorted(self.packages)}


@dataclass(frozen=True, kw_only=True)
class BaseRef:
    """Where a build stage starts: a bootstrapped base, or a registry image (tag, optional digest)."""
    bootstrap: BootstrapBase | None = None
    image: str = ""
    digest: str = ""

    def describe(self) -> str:
        if self.bootstrap:
            return f"bootstrap:{self.bootstrap.name}"
        return f"{self.image}@{self.digest}" if self.digest else self.image


def load_bootstrap_base(path: Path, problems: Problems) -> BootstrapBase | None:
    spec_file = path / "base.yaml" if path.is_dir() else path
    data = load_yaml(spec_file, problems, "bootstrap base spec")
    f = Fields(display_path(spec_file), problems)
    if data is None:
        return None
    f.unknown_keys(data, "", {"name", "suite", "variant", "mirror", "packages"})
    name = f.get(data, "name", "", str)
    suite = f.get(data, "suite", "", str)
    variant = f.get(data, "variant", "", str, required=False, default="minbase")
    mirror = f.get(data, "mirror", "", str, required=False, default="http://deb.debian.org/debian")
    packages = f.str_list(data, "packages", "")
    for i, pkg in enumerate(packages):
        if not re.match(r"^[a-z0-9][a-z0-9+.-]+$", pkg):
            f.fail(f"packages[{i}]", f"{pkg!r} is not a Debian package name", "use the package name as apt knows it")
    if name and not NAME_RE.match(name):
        f.fail("name", f"{name!r} is not a valid image name", "use lowercase letters, digits, '.', '_' and '-'")
        return None
    if None in (name, suite):
        return None
    return BootstrapBase(name=name, path=spec_file.parent, suite=suite, variant=variant, mirror=mirror,
                         packages=packages)


# ---- image spec ----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RuntimeUser:
    name: str
    uid: int


@dataclass(frozen=True, kw_only=True)
class ImageSpec:
    name: str
    directory: Path
    description: str
    toolchain: str
    platform: str
    builder_base: BaseRef
    runtime_base: BaseRef
    target_archs: tuple[str, ...]
    kernels: tuple[str, ...]
    python_requirements: tuple[str, ...]
    user: RuntimeUser
    labels: dict[str, str]
    model_family: str
    attn_implementation: str
    finetune_defaults: dict[str, Any]
    runtime_apt_note: str = ""


def load_image_spec(directory: Path, problems: Problems | None = None) -> ImageSpec | None:
    own = problems is None
    problems = Problems() if problems is None else problems
    directory = Path(directory)
    spec_file = directory / "image.yaml" if directory.is_dir() or not directory.suffix else directory
    directory = spec_file.parent
    data = load_yaml(spec_file, problems, "image spec")
    f = Fields(display_path(spec_file), problems)
    spec = None
    if data is not None:
        spec = _load_image(f, data, directory)
    if own:
        problems.raise_if_any()
    return spec


def _load_image(f: Fields, data: dict, directory: Path) -> ImageSpec | None:
    f.unknown_keys(data, "", {"name", "description", "toolchain", "platform", "bases", "target_archs", "kernels",
                              "python", "runtime", "labels", "model_family", "finetune"})
    name = f.get(data, "name", "", str)
    if name and not NAME_RE.match(name):
        f.fail("name", f"{name!r} is not a valid image name", "use lowercase letters, digits, '.', '_' and '-'")
        name = None
    description = f.get(data, "description", "", str, required=False, default="")
    toolchain = f.get(data, "toolchain", "", str, fix="name a toolchain from kernels_manifest.yaml")
    platform = f.get(data, "platform", "", str, required=False, default="linux_x86_64")
    if platform not in PLATFORMS:
        f.fail("platform", f"unknown platform {platform!r}", f"use one of: {', '.join(PLATFORMS)}", "unknown-platform")
    bases = f.get(data, "bases", "", dict, default={})
    builder = _load_base_ref(f, bases, "builder")
    runtime = _load_base_ref(f, bases, "runtime")
    archs = f.str_list(data, "target_archs", "", required=False)
    for i, arch in enumerate(archs):
        if not ARCH_RE.match(arch):
            f.fail(f"target_archs[{i}]", f"{arch!r} is not an arch name", 'write archs as "sm_90", "sm_100"',
                   "unknown-arch")
    if len(set(archs)) != len(archs):
        f.fail("target_archs", "an arch is listed twice", "list each arch once", "duplicate")
    kernels = f.str_list(data, "kernels", "", required=False)
    seen = set()
    for i, kernel in enumerate(kernels):
        if kernel in seen:
            f.fail(f"kernels[{i}]", f"kernel {kernel!r} is listed twice", "list each kernel once", "duplicate-kernel")
        seen.add(kernel)
    python = f.get(data, "python", "", dict, default={})
    requirements = f.str_list(python, "requirements", "python") if python else ()
    for i, req in enumerate(requirements):
        parsed = _check_pinned_requirement(f, req, f"python.requirements[{i}]")
        if parsed and parsed.name.lower() == "torch":
            f.fail(f"python.requirements[{i}]", "torch is set by the toolchain, not here",
                   "remove torch from python.requirements; pick a toolchain instead", "torch-in-requirements")
    runtime_body = f.get(data, "runtime", "", dict, default={})
    user = None
    attn = "sdpa"
    if runtime_body:
        f.unknown_keys(runtime_body, "runtime", {"user", "uid", "attn_implementation"})
        uname = f.get(runtime_body, "user", "runtime", str)
        uid = f.get(runtime_body, "uid", "runtime", int)
        attn = f.get(runtime_body, "attn_implementation", "runtime", str, required=False, default="sdpa")
        if uid is not None and (isinstance(uid, bool) or uid <= 0 or uid >= 2 ** 31):
            f.fail("runtime.uid", f"uid {uid} is root or out of range", "use a fixed non-root uid such as 10001",
                   "root-user")
            uid = None
        if uname == "root":
            f.fail("runtime.user", "the runtime user may not be root", "name a non-root user, e.g. trainer",
                   "root-user")
            uname = None
        if uname and not re.match(r"^[a-z_][a-z0-9_-]{0,30}$", uname):
            f.fail("runtime.user", f"{uname!r} is not a valid user name", "use lowercase letters, digits, '_' or '-'")
            uname = None
        if uname and uid:
            user = RuntimeUser(name=uname, uid=uid)
    labels = f.str_map(data, "labels", "")
    for key, value in labels.items():
        if looks_secret(key, value):
            f.fail(f"labels.{key}", "label looks like it carries a secret (labels are public image metadata)",
                   "remove the secret; pass credentials at run time, never in the image", "secret")
    model_family = f.get(data, "model_family", "", str)
    finetune = f.get(data, "finetune", "", dict, required=False, default={})
    if finetune:
        f.unknown_keys(finetune, "finetune", {"defaults", "config_file"})
    defaults = dict(f.get(finetune, "defaults", "finetune", dict, required=False, default={}) or {})
    config_file = f.get(finetune, "config_file", "finetune", str, required=False, default="") if finetune else ""
    if config_file:
        resolved = _check_inside(f, directory, config_file, "finetune.config_file", "the image folder")
        if resolved:
            import yaml  # local: only needed for this optional file
            try:
                loaded = yaml.safe_load(resolved.read_text()) or {}
            except yaml.YAMLError as exc:
                f.fail("finetune.config_file", f"{config_file} is malformed YAML: {str(exc).splitlines()[0]}",
                       "fix its YAML syntax", "malformed-yaml")
                loaded = {}
            if isinstance(loaded, dict):
                defaults = {**loaded, **defaults}
    _check_finetune_defaults(f, defaults)
    if not runtime_body:
        f.fail("runtime", "required field is missing", "add runtime: {user: trainer, uid: 10001}", "missing-field")
    if None in (name, toolchain, builder, runtime, model_family):
        return None
    # An invalid user is already recorded as a problem; keep going so resolution can report
    # its own problems in the same run (the plan is never used while problems exist).
    user = user or RuntimeUser(name="invalid", uid=0)
    return ImageSpec(name=name, directory=directory, description=description, toolchain=toolchain,
                     platform=platform, builder_base=builder, runtime_base=runtime, target_archs=archs,
                     kernels=kernels, python_requirements=requirements, user=user, labels=labels,
                     model_family=model_family, attn_implementation=attn, finetune_defaults=defaults)


def _check_finetune_defaults(f: Fields, defaults: dict) -> None:
    """Validate with the entrypoint's own config schema, so bad defaults fail the build (exit 2),
    not every training job that later starts from this image."""
    from entrypoint.config import ConfigError, build_config
    # model.path and data.path are per run; stand-ins let everything else be checked.
    per_run = {"model": {"path": "/run-time/model"}, "data": {"path": "/run-time/data.jsonl"}}
    try:
        build_config([per_run, defaults])
    except ConfigError as exc:
        for where, problem, fix in exc.problems:
            f.fail(f"finetune.defaults.{where}", problem, fix, "finetune-config")


def _load_base_ref(f: Fields, bases: dict, stage: str) -> BaseRef | None:
    where = f"bases.{stage}"
    body = f.get(bases, stage, "bases", dict,
                 fix=f"add bases.{stage}: {{bootstrap: debian-bookworm}} or {{image: TAG, digest: sha256:...}}")
    if body is None:
        return None
    f.unknown_keys(body, where, {"bootstrap", "image", "digest"})
    if "bootstrap" in body and ("image" in body or "digest" in body):
        f.fail(where, "both bootstrap and image given", "name either a bootstrapped base or a registry image")
        return None
    if "bootstrap" in body:
        base_name = f.get(body, "bootstrap", where, str)
        if base_name is None:
            return None
        if not NAME_RE.match(base_name) or "/" in base_name:
            f.fail(f"{where}.bootstrap", f"{base_name!r} is not a base name", "name a folder under images/_bases/",
                   "path-outside")
            return None
        base_dir = BASES_DIR / base_name
        if not (base_dir / "base.yaml").is_file():
            known = sorted(p.name for p in BASES_DIR.iterdir() if (p / "base.yaml").is_file()) \
                if BASES_DIR.is_dir() else []
            f.fail(f"{where}.bootstrap", f"no bootstrap base named {base_name!r}",
                   f"use one of: {', '.join(known) or '(none)'}, or add images/_bases/{base_name}/base.yaml",
                   "unknown-base")
            return None
        base = load_bootstrap_base(base_dir, f.problems)
        return BaseRef(bootstrap=base) if base else None
    image = f.get(body, "image", where, str, fix="give image: REPO:TAG, ideally with digest: sha256:...")
    digest = f.get(body, "digest", where, str, required=False, default="")
    if digest and not DIGEST_RE.match(digest):
        f.fail(f"{where}.digest", f"not an image digest: {digest[:40]!r}",
               "use the full sha256:<64 hex> digest from `docker inspect --format '{{.RepoDigests}}'`", "bad-sha256")
        return None
    if image is None:
        return None
    if ":" not in image.rsplit("/", 1)[-1] and not digest:
        f.fail(f"{where}.image", f"{image!r} has neither a tag nor a digest",
               "pin it: image: REPO:TAG plus digest: sha256:...", "unpinned")
        return None
    return BaseRef(image=image, digest=digest)


_SECRET_KEY = re.compile(r"(password|passwd|secret|token|api[_-]?key|credential|private[_-]?key)", re.I)
_SECRET_VALUE = re.compile(r"(hf_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}|ghp_[A-Za-z0-9]{30,}|-----BEGIN [A-Z ]*PRIVATE KEY)")


def looks_secret(key: str, value: str) -> bool:
    return bool(_SECRET_KEY.search(key) or _SECRET_VALUE.search(value))
