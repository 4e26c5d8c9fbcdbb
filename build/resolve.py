"""Resolve an image spec against the manifest and compatibility data into a frozen BuildPlan.

Every kernel wheel gets a content-addressed key: the sha256 of the full tuple that
determines its bytes (kernel version and source sha256, patches, build env, torch wheel
sha256, CUDA, Python, C++ ABI, arch list, compiler, platform). Change any one input and
exactly the keys that depend on it change; identical inputs give byte-identical plans.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from build import compat
from build.fields import display_path
from build.errors import Problems
from build.spec import (REPO_ROOT, BaseRef, ImageSpec, Kernel, Manifest, PinnedFile, SourcePatch, Toolchain,
                        load_image_spec, load_manifest, MANIFEST_PATH)

PLAN_SCHEMA = 1


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest(data: Any) -> str:
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class KernelPlan:
    name: str
    version: str
    kind: str
    import_name: str
    extension_module: str
    key: str
    key_inputs: dict[str, Any]
    sources: tuple[PinnedFile, ...]       # one sdist, or the pinned wheels of a pure-Python kernel
    patches: tuple[SourcePatch, ...]      # only those that apply to this toolchain
    build_env: dict[str, str]             # FORCE_BUILD knobs plus the arch knob's rendered value
    archs: tuple[str, ...]
    forward_entry_points: tuple[str, ...]
    backward_entry_points: tuple[str, ...]
    other_entry_points: tuple[str, ...]
    replaces: tuple[str, ...]
    runtime_requires: tuple[str, ...]
    build_requires: tuple[str, ...]
    memory_per_job_gb: float

    @property
    def compiled(self) -> bool:
        return self.kind == "cuda-extension"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "version": self.version, "kind": self.kind, "key": self.key,
            "import_name": self.import_name, "extension_module": self.extension_module,
            "sources": [{"filename": s.filename, "sha256": s.sha256, "url": s.url} for s in self.sources],
            "patches": [{"path": p.path, "sha256": p.sha256, "reason": p.reason} for p in self.patches],
            "build_env": dict(sorted(self.build_env.items())), "archs": list(self.archs),
            "entry_points": {"forward": list(self.forward_entry_points),
                             "backward": list(self.backward_entry_points),
                             "other": list(self.other_entry_points)},
            "replaces": list(self.replaces), "runtime_requires": list(self.runtime_requires),
            "build_requires": list(self.build_requires),
        }


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    spec: ImageSpec
    toolchain: Toolchain
    torch_wheel: PinnedFile
    kernels: tuple[KernelPlan, ...]
    python_requirements: tuple[str, ...]   # image requirements + kernels' runtime needs, sorted
    plan_key: str = ""
    _body: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def tag(self) -> str:
        return f"{self.spec.name}:{self.plan_key[:12]}"

    def to_dict(self) -> dict[str, Any]:
        return {**self._body, "plan_key": self.plan_key}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"


def base_descriptor(base: BaseRef) -> dict[str, Any]:
    if base.bootstrap:
        return {"bootstrap": base.bootstrap.name, "spec_sha256": digest(base.bootstrap.spec_dict())}
    return {"image": base.image, "digest": base.digest}


def resolve(spec: ImageSpec, manifest: Manifest, problems: Problems | None = None) -> BuildPlan:
    """Raise SpecErrors with every problem found (including any the caller already collected)."""
    problems = Problems() if problems is None else problems
    spec_file = display_path(spec.directory / "image.yaml")
    toolchain = manifest.toolchains.get(spec.toolchain)
    if toolchain is None:
        problems.add(spec_file, "toolchain", f"unknown toolchain {spec.toolchain!r}",
                     f"use one of: {', '.join(sorted(manifest.toolchains)) or '(none)'} from kernels_manifest.yaml",
                     "unknown-toolchain")
        problems.raise_if_any()
    torch_wheel = toolchain.torch_wheels.get(spec.platform)
    if torch_wheel is None:
        problems.add(spec_file, "platform", f"toolchain {toolchain.name!r} pins no torch wheel for {spec.platform}",
                     f"add toolchains.{toolchain.name}.torch.wheels.{spec.platform} to kernels_manifest.yaml",
                     "no-torch-wheel")
    _check_toolchain(problems, spec_file, toolchain)
    _check_archs(problems, spec_file, spec, toolchain)
    if spec.attn_implementation == "flash_attention_2" and "flash-attn" not in spec.kernels:
        problems.add(spec_file, "runtime.attn_implementation", "flash_attention_2 needs the flash-attn kernel",
                     "add flash-attn to kernels, or use sdpa", "attn-needs-kernel")
    kernels = []
    for i, name in enumerate(spec.kernels):
        kernel = manifest.kernels.get(name)
        if kernel is None:
            problems.add(spec_file, f"kernels[{i}]", f"unknown kernel {name!r}",
                         f"use one of: {', '.join(sorted(manifest.kernels))}, or add it to kernels_manifest.yaml",
                         "unknown-kernel")
        elif kernel not in kernels:
            _check_kernel(problems, spec_file, f"kernels[{i}]", kernel, spec, toolchain)
            kernels.append(kernel)
    requirements = _merge_requirements(problems, spec_file, spec, kernels)
    problems.raise_if_any()
    kernel_plans = [_plan_kernel(kernel, spec, toolchain, torch_wheel) for kernel in kernels]

    body = {
        "schema": PLAN_SCHEMA,
        "image": spec.name,
        "description": spec.description,
        "platform": spec.platform,
        "toolchain": {"name": toolchain.name, "python": toolchain.python, "torch": toolchain.torch_version,
                      "torch_wheel": {"filename": torch_wheel.filename, "sha256": torch_wheel.sha256},
                      "cuda": toolchain.cuda, "cxx11_abi": toolchain.cxx11_abi, "compiler": toolchain.compiler,
                      "cuda_pip_toolchain": list(toolchain.cuda_pip_toolchain)},
        "target_archs": list(spec.target_archs),
        "bases": {"builder": base_descriptor(spec.builder_base), "runtime": base_descriptor(spec.runtime_base)},
        "kernels": [k.to_dict() for k in kernel_plans],
        "python_requirements": list(requirements),
        "runtime": {"user": spec.user.name, "uid": spec.user.uid, "attn_implementation": spec.attn_implementation},
        "model_family": spec.model_family,
        "labels": dict(sorted(spec.labels.items())),
        "finetune_defaults": spec.finetune_defaults,
    }
    return BuildPlan(spec=spec, toolchain=toolchain, torch_wheel=torch_wheel, kernels=tuple(kernel_plans),
                     python_requirements=requirements, plan_key=digest(body), _body=body)


def load_plan(image_dir: Path, manifest_path: Path = MANIFEST_PATH) -> BuildPlan:
    """Load and validate both files, collecting every problem, then resolve."""
    problems = Problems()
    manifest = load_manifest(manifest_path, problems)
    spec = load_image_spec(image_dir, problems)
    if spec is None:
        problems.raise_if_any()
    return resolve(spec, manifest, problems)


def _check_toolchain(problems: Problems, spec_file: str, toolchain: Toolchain) -> None:
    manifest_file = "kernels_manifest.yaml"
    releases = compat.torch_releases()
    minor = compat.torch_minor(toolchain.torch_version)
    release = releases.get(minor)
    where = f"toolchains.{toolchain.name}"
    if release is None:
        problems.add(manifest_file, f"{where}.torch.version", f"torch {minor} is not in build/compat/torch.yaml",
                     "add its CUDA and Python support to build/compat/torch.yaml, or pick a listed torch",
                     "unknown-torch")
        return
    if toolchain.cuda not in release.cuda:
        problems.add(manifest_file, f"{where}.cuda", f"torch {minor} ships no build for CUDA {toolchain.cuda}",
                     f"use one of: {', '.join(release.cuda)}", "torch-cuda")
    local = Version(toolchain.torch_version).local
    if toolchain.is_cpu != (local == "cpu") and local is not None:
        problems.add(manifest_file, f"{where}.torch.version",
                     f"torch {toolchain.torch_version} does not match cuda: {toolchain.cuda}",
                     "pin the torch build that matches the toolchain's CUDA (e.g. 2.13.0+cpu for cuda: cpu)",
                     "torch-cuda")
    if not release.python.contains(toolchain.python + ".0"):
        problems.add(manifest_file, f"{where}.python", f"torch {minor} has no wheels for Python {toolchain.python}",
                     f"use a Python in {release.python}", "torch-python")


def _check_archs(problems: Problems, spec_file: str, spec: ImageSpec, toolchain: Toolchain) -> None:
    facts = compat.arch_facts()
    if toolchain.is_cpu and spec.target_archs:
        problems.add(spec_file, "target_archs", f"toolchain {toolchain.name} is CPU-only but GPU archs are listed",
                     "remove target_archs, or pick a CUDA toolchain", "arch-cpu")
        return
    if not toolchain.is_cpu and not spec.target_archs:
        problems.add(spec_file, "target_archs", "a CUDA image needs at least one target arch",
                     'list the GPUs you run on, e.g. target_archs: [sm_90]', "missing-field")
    for i, arch in enumerate(spec.target_archs):
        fact = facts.get(arch)
        if fact is None:
            problems.add(spec_file, f"target_archs[{i}]", f"unknown arch {arch!r}",
                         f"use one of: {', '.join(facts)}", "unknown-arch")
        elif not toolchain.is_cpu and not fact.supported_by(toolchain.cuda):
            limit = f"needs CUDA >= {fact.min_cuda}" + (f" and <= {fact.max_cuda}" if fact.max_cuda else "")
            problems.add(spec_file, f"target_archs[{i}]",
                         f"{arch} ({fact.name}) {limit}; toolchain {toolchain.name} has CUDA {toolchain.cuda}",
                         "drop the arch, or pick a toolchain whose CUDA can target it", "arch-cuda")


def _check_kernel(problems: Problems, spec_file: str, where: str, kernel: Kernel, spec: ImageSpec,
                  toolchain: Toolchain) -> None:
    c = kernel.constraints
    if toolchain.is_cpu:
        problems.add(spec_file, where, f"kernel {kernel.name} needs CUDA; toolchain {toolchain.name} is CPU-only",
                     "remove the kernel, or pick a CUDA toolchain", "kernel-cpu")
        return
    checks = [("python", toolchain.python, c.python), ("torch", toolchain.torch_version, c.torch),
              ("cuda", toolchain.cuda, c.cuda)]
    for what, have, allowed in checks:
        if allowed and not SpecifierSet(allowed).contains(Version(have).public if what == "torch" else have,
                                                          prereleases=True):
            problems.add(spec_file, where, f"{kernel.name} {kernel.version} needs {what} {allowed}; "
                         f"toolchain {toolchain.name} has {what} {have}",
                         f"pick a toolchain with {what} {allowed}, or a {kernel.name} version that supports {have}",
                         f"kernel-{what}")
    for arch in spec.target_archs:
        if c.archs and arch not in c.archs and arch in compat.arch_facts():
            problems.add(spec_file, where, f"{kernel.name} {kernel.version} cannot be built for {arch}",
                         f"its archs are {', '.join(c.archs)}; drop {arch} or that kernel", "kernel-arch")
    for patch in kernel.patches:
        path = REPO_ROOT / patch.path
        if not path.is_file():
            continue  # already reported by the manifest loader
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != patch.sha256:
            problems.add("kernels_manifest.yaml", f"kernels.{kernel.name}.patches", f"patch {patch.path} has sha256 "
                         f"{actual[:16]}..., the manifest pins {patch.sha256[:16]}...",
                         "restore the patch file, or re-pin its sha256 after reviewing the change", "bad-sha256")


def _applicable_patches(kernel: Kernel, toolchain: Toolchain) -> tuple[SourcePatch, ...]:
    torch = Version(toolchain.torch_version).public
    return tuple(p for p in kernel.patches if not p.when_torch or SpecifierSet(p.when_torch).contains(torch))


def _plan_kernel(kernel: Kernel, spec: ImageSpec, toolchain: Toolchain, torch_wheel: PinnedFile) -> KernelPlan:
    archs = tuple(sorted(spec.target_archs, key=lambda a: int(a[3:])))
    build_env = dict(kernel.build_env)
    if kernel.arch_knob:
        build_env[kernel.arch_knob.env] = kernel.arch_knob.render(archs)
    sources = (kernel.sdist,) if kernel.sdist else kernel.wheels
    patches = _applicable_patches(kernel, toolchain)
    key_inputs = {
        "kernel": kernel.name, "version": kernel.version, "kind": kernel.kind,
        "sources": [s.sha256 for s in sources], "patches": [p.sha256 for p in patches],
        "build_env": dict(sorted(build_env.items())),
        "torch_wheel_sha256": torch_wheel.sha256, "cuda": toolchain.cuda, "python": toolchain.python,
        "cxx11_abi": toolchain.cxx11_abi, "archs": list(archs), "compiler": toolchain.compiler,
        "cuda_pip_toolchain": list(toolchain.cuda_pip_toolchain), "platform": spec.platform,
        "build_requires": list(kernel.build_requires),
    }
    if kernel.kind == "triton":
        # Nothing is compiled: the wheel bytes depend only on the pinned sources. Keeping the
        # key narrow lets the same cache entry serve every toolchain.
        key_inputs = {k: key_inputs[k] for k in ("kernel", "version", "kind", "sources")}
    return KernelPlan(name=kernel.name, version=kernel.version, kind=kernel.kind, import_name=kernel.import_name,
                      extension_module=kernel.extension_module, key=digest(key_inputs), key_inputs=key_inputs,
                      sources=sources, patches=patches, build_env=build_env, archs=archs,
                      forward_entry_points=kernel.forward_entry_points,
                      backward_entry_points=kernel.backward_entry_points,
                      other_entry_points=kernel.other_entry_points, replaces=kernel.replaces,
                      runtime_requires=kernel.runtime_requires, build_requires=kernel.build_requires,
                      memory_per_job_gb=kernel.memory_per_job_gb)


def _merge_requirements(problems: Problems, spec_file: str, spec: ImageSpec,
                        kernels: list[Kernel]) -> tuple[str, ...]:
    seen: dict[str, str] = {}
    for i, req in enumerate(spec.python_requirements):
        name = Requirement(req).name.lower().replace("_", "-")
        if name in seen:
            problems.add(spec_file, f"python.requirements[{i}]", f"{name} is listed twice",
                         "keep one pin per package", "duplicate")
        seen[name] = req
    for kernel in kernels:
        for req in kernel.runtime_requires:
            name = Requirement(req).name.lower().replace("_", "-")
            seen.setdefault(name, req)
    return tuple(sorted(seen.values(), key=str.lower))

