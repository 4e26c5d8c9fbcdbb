"""Stage 3: resolve an image spec against the manifest, the compatibility data and the model
family into a frozen BuildPlan.

Every kernel wheel gets a content-addressed key over the full tuple that determines its
bytes: kernel version and source sha256, patches, build env (arch and specialisation
knobs included), torch wheel sha256, CUDA, Python, C++ ABI, archs, compiler, platform.
Change one input and exactly the keys that depend on it change.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from build.resolve import compat_checks, family_needs
from build.resolve.build_plan import BuildPlan, CompileEstimate, KernelPlan, canonical_json, digest
from build.resolve.specialise import estimate, specialise
from build.spec import (
    MANIFEST_PATH,
    BaseRef,
    ImageSpec,
    Kernel,
    Manifest,
    PinnedFile,
    SourcePatch,
    SpecErrors,
    Toolchain,
    display_path,
    load_image_spec,
    load_manifest,
)
from contracts.lock import RuntimeConstraint, Specialisation
from contracts.schema import Problems
from families import Family, FamilyError, UnknownFamily, load_family

__all__ = ["BuildPlan", "CompileEstimate", "KernelPlan", "canonical_json", "digest", "load_plan", "resolve",
           "base_descriptor"]


def base_descriptor(base: BaseRef) -> dict:
    if base.bootstrap:
        return {"bootstrap": base.bootstrap.name, "spec_sha256": digest(base.bootstrap.spec_dict())}
    return {"image": base.image, "digest": base.digest}


def load_plan(image_dir: Path, manifest_path: Path = MANIFEST_PATH) -> BuildPlan:
    """Load and validate both files, collecting every problem, then resolve."""
    problems = Problems()
    manifest = load_manifest(manifest_path, problems)
    spec = load_image_spec(image_dir, problems)
    if spec is None:
        problems.raise_if_any(SpecErrors)
    return resolve(spec, manifest, problems)


def _families(spec: ImageSpec, problems: Problems) -> tuple[Family, ...]:
    """The image's families; empty when one of them is unusable (its problems are recorded)."""
    found = []
    for name in spec.families:
        try:
            found.append(load_family(name))
        except UnknownFamily:
            return ()  # reported by the image spec's own validation
        except FamilyError as exc:
            problems.items.extend(exc.problems)
            return ()
    return tuple(found)


def resolve(spec: ImageSpec, manifest: Manifest, problems: Problems | None = None, *,
            host: tuple[Toolchain, PinnedFile] | None = None) -> BuildPlan:
    """Raise SpecErrors with every problem found (including any the caller already collected).

    `host`: resolve for an observed toolchain (this machine's Python and torch, see this_host.py)
    instead of the image's pinned one; the compatibility data is then not consulted, because
    the toolchain is what is installed, not a choice."""
    problems = Problems() if problems is None else problems
    spec_file = display_path(spec.directory / "image.yaml")
    toolchain = host[0] if host else manifest.toolchains.get(spec.toolchain)
    if toolchain is None:
        if (f"toolchains.{spec.toolchain}" not in manifest.broken and manifest.toolchains
                and not problems.touches(spec_file, "toolchain")):
            problems.add(spec_file, "toolchain", f"unknown toolchain {spec.toolchain!r}",
                         f"use one of: {', '.join(sorted(manifest.toolchains))} from kernels_manifest.yaml",
                         "unknown-toolchain")
        problems.raise_if_any(SpecErrors)
        raise SpecErrors([])  # unreachable: a missing toolchain is always reported above or in the manifest
    torch_wheel = host[1] if host else toolchain.torch_wheels.get(spec.platform)
    if torch_wheel is None:
        problems.add(spec_file, "platform", f"toolchain {toolchain.name!r} pins no torch wheel for {spec.platform}",
                     f"add toolchains.{toolchain.name}.torch.wheels.{spec.platform} to kernels_manifest.yaml",
                     "no-torch-wheel")
    if not host:
        compat_checks.toolchain(problems, toolchain)
    compat_checks.archs(problems, spec_file, spec, toolchain)
    families = _families(spec, problems)
    if spec.attn_implementation == "flash_attention_2" and not any(
            "attention:flash_attention_2" in manifest.kernels[k].replaces for k in spec.kernels if k in
            manifest.kernels) and not any(f"kernels.{k}" in manifest.broken for k in spec.kernels):
        problems.add(spec_file, "runtime.attn_implementation", "flash_attention_2 needs the flash-attn kernel",
                     "add flash-attn to kernels, or use sdpa", "attn-needs-kernel")
    kernels: list[Kernel] = []
    for i, name in enumerate(spec.kernels):
        kernel = manifest.kernels.get(name)
        if kernel is None:
            if f"kernels.{name}" not in manifest.broken:
                problems.add(spec_file, f"kernels[{i}]", f"unknown kernel {name!r}",
                             f"use one of: {', '.join(sorted(manifest.kernels))}, or add it to kernels_manifest.yaml",
                             "unknown-kernel")
        elif kernel not in kernels:
            compat_checks.kernel(problems, spec_file, f"kernels[{i}]", kernel, spec, toolchain)
            kernels.append(kernel)
    specialised = {k.name: specialise(k, spec, families, problems, spec_file) for k in kernels}
    used = family_needs.check(problems, spec_file, spec, toolchain, families, kernels, manifest.kernels)
    requirements = _merge_requirements(problems, spec_file, spec, kernels)
    if not host:
        compat_checks.runtime_constraints(problems, spec_file, spec, kernels, requirements)
    problems.raise_if_any(SpecErrors)
    kernel_plans = [_plan_kernel(k, spec, toolchain, torch_wheel, *specialised[k.name], used) for k in kernels]

    body = {
        "schema": 2,
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
        "specialise_kernels": spec.specialise_kernels,
        "python_requirements": list(requirements),
        "runtime": {"user": spec.user.name, "uid": spec.user.uid, "gid": spec.gid,
                    "attn_implementation": spec.attn_implementation},
        # the one-family form keeps its old key, so a one-family image's plan key does not move
        **({"model_families": list(spec.model_families)} if spec.model_families
           else {"model_family": spec.model_family}),
        "labels": dict(sorted(spec.labels.items())),
        "finetune_defaults": spec.finetune_defaults,
    }
    return BuildPlan(spec=spec, toolchain=toolchain, torch_wheel=torch_wheel, kernels=tuple(kernel_plans),
                     python_requirements=requirements, plan_key=digest(body), body=body)


def _applicable_patches(kernel: Kernel, toolchain: Toolchain) -> tuple[SourcePatch, ...]:
    torch = Version(toolchain.torch_version).public
    return tuple(p for p in kernel.patches if not p.when_torch or SpecifierSet(p.when_torch).contains(torch))


def _plan_kernel(kernel: Kernel, spec: ImageSpec, toolchain: Toolchain, torch_wheel: PinnedFile,
                 specialisation: Specialisation, specialise_env: dict[str, str], used: frozenset[str]) -> KernelPlan:
    archs = tuple(sorted(spec.target_archs, key=lambda a: int(a[3:])))
    build_env = dict(kernel.build_env)
    if kernel.arch_knob:
        build_env[kernel.arch_knob.env] = kernel.arch_knob.render(archs)
    build_env.update(specialise_env)
    sources = (kernel.sdist,) if kernel.sdist else kernel.wheels
    patches = _applicable_patches(kernel, toolchain)
    key_inputs = {
        "kernel": kernel.name, "version": kernel.version, "kind": kernel.kind,
        "sources": [s.sha256 for s in sources], "patches": [p.sha256 for p in patches],
        "build_env": dict(sorted(build_env.items())),
        "torch_wheel_sha256": torch_wheel.sha256, "cuda": toolchain.cuda, "python": toolchain.python,
        "cxx11_abi": toolchain.cxx11_abi, "archs": list(archs), "compiler": toolchain.compiler,
        "cuda_pip_toolchain": list(toolchain.cuda_pip_toolchain), "platform": spec.platform,
        "build_requires": list(kernel.build_requires), "specialisation": asdict(specialisation),
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
                      other_entry_points=kernel.other_entry_points,
                      # only what the image's families use: a function a kernel adds for another
                      # family does not move this image's plan
                      replaces=tuple(r for r in kernel.replaces if r in used),
                      python_api={f: s for f, s in kernel.python_api.items() if f in used},
                      profile_kernels={"forward": kernel.profile_kernels.forward,
                                       "backward": kernel.profile_kernels.backward},
                      runtime_requires=kernel.runtime_requires, build_requires=kernel.build_requires,
                      memory_per_job_gb=kernel.memory_per_job_gb, specialisation=specialisation,
                      estimate=estimate(kernel, specialisation, len(archs)),
                      runtime_constraints=tuple(RuntimeConstraint(package=c.package, version=c.version,
                                                                  archs=c.archs, reason=c.reason)
                                                for c in kernel.runtime_constraints))


def _merge_requirements(problems: Problems, spec_file: str, spec: ImageSpec,
                        kernels: list[Kernel]) -> tuple[str, ...]:
    seen: dict[str, str] = {}
    for i, req in enumerate(spec.python_requirements):
        try:
            name = Requirement(req).name.lower().replace("_", "-")
        except Exception:  # noqa: BLE001 - already reported as an invalid requirement
            continue
        if name in seen:
            problems.add(spec_file, f"python.requirements[{i}]", f"{name} is listed twice",
                         "keep one pin per package", "duplicate")
        seen[name] = req
    for kernel in kernels:
        for req in kernel.runtime_requires:
            name = Requirement(req).name.lower().replace("_", "-")
            seen.setdefault(name, req)
    return tuple(sorted(seen.values(), key=str.lower))
