"""Cross-file compatibility: the image against the manifest and build/compat/*.yaml.

Each rule records problems and never raises, so one run reports every problem.
"""
from __future__ import annotations

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from build.resolve import compat
from build.spec import ImageSpec, Kernel, Toolchain
from contracts.schema import Problems

MANIFEST_FILE = "kernels_manifest.yaml"


def toolchain(problems: Problems, tc: Toolchain) -> None:
    releases = compat.torch_releases()
    minor = compat.torch_minor(tc.torch_version)
    release = releases.get(minor)
    where = f"toolchains.{tc.name}"
    if release is None:
        problems.add(MANIFEST_FILE, f"{where}.torch.version", f"torch {minor} is not in build/compat/torch.yaml",
                     "add its CUDA and Python support to build/compat/torch.yaml, or pick a listed torch",
                     "unknown-torch")
        return
    if tc.cuda not in release.cuda:
        problems.add(MANIFEST_FILE, f"{where}.cuda", f"torch {minor} ships no build for CUDA {tc.cuda}",
                     f"use one of: {', '.join(release.cuda)}", "torch-cuda")
    local = Version(tc.torch_version).local
    if local is not None and tc.is_cpu != (local == "cpu"):
        problems.add(MANIFEST_FILE, f"{where}.torch.version",
                     f"torch {tc.torch_version} does not match cuda: {tc.cuda}",
                     "pin the torch build that matches the toolchain's CUDA (e.g. 2.13.0+cpu for cuda: cpu)",
                     "torch-cuda")
    if not release.python.contains(tc.python + ".0"):
        problems.add(MANIFEST_FILE, f"{where}.python", f"torch {minor} has no wheels for Python {tc.python}",
                     f"use a Python in {release.python}", "torch-python")


def archs(problems: Problems, spec_file: str, spec: ImageSpec, tc: Toolchain) -> None:
    facts = compat.arch_facts()
    if tc.is_cpu and spec.target_archs:
        problems.add(spec_file, "target_archs", f"toolchain {tc.name} is CPU-only but GPU archs are listed",
                     "remove target_archs, or pick a CUDA toolchain", "arch-cpu")
        return
    if not tc.is_cpu and not spec.target_archs and not problems.touches(spec_file, "target_archs"):
        problems.add(spec_file, "target_archs", "a CUDA image needs at least one target arch",
                     'list the GPUs you run on, e.g. target_archs: [sm_90]', "missing-field")
    for i, arch in enumerate(spec.target_archs):
        fact = facts.get(arch)
        if fact is None:
            problems.add(spec_file, f"target_archs[{i}]", f"unknown arch {arch!r}",
                         f"use one of: {', '.join(facts)}", "unknown-arch")
        elif not tc.is_cpu and not fact.supported_by(tc.cuda):
            limit = f"needs CUDA >= {fact.min_cuda}" + (f" and <= {fact.max_cuda}" if fact.max_cuda else "")
            problems.add(spec_file, f"target_archs[{i}]",
                         f"{arch} ({fact.name}) {limit}; toolchain {tc.name} has CUDA {tc.cuda}",
                         "drop the arch, or pick a toolchain whose CUDA can target it", "arch-cuda")


def runtime_constraints(problems: Problems, spec_file: str, spec: ImageSpec, kernels: list[Kernel],
                        requirements: tuple[str, ...]) -> None:
    """The image's pins must satisfy what each kernel needs at run time on the image's archs."""
    pins = {}
    for req in requirements:
        try:
            parsed = Requirement(req)
        except Exception:  # noqa: BLE001 - an invalid requirement is already reported by the spec
            continue
        exact = [s.version for s in parsed.specifier if s.operator == "=="]
        if len(exact) == 1:
            pins[canonicalize_name(parsed.name)] = exact[0]
    for k in kernels:
        for c in k.runtime_constraints:
            archs = [a for a in spec.target_archs if not c.archs or a in c.archs]
            have = pins.get(canonicalize_name(c.package))
            if archs and have and not SpecifierSet(c.version).contains(have, prereleases=True):
                problems.add(spec_file, "python.requirements", f"the image pins {c.package} {have}, but {k.name} "
                             f"needs {c.package}{c.version} on {', '.join(archs)}: {c.reason}",
                             f"pin {c.package}{c.version} (or a toolchain whose torch brings it)", "kernel-runtime")


def kernel(problems: Problems, spec_file: str, where: str, k: Kernel, spec: ImageSpec, tc: Toolchain) -> None:
    c = k.constraints
    if tc.is_cpu:
        problems.add(spec_file, where, f"kernel {k.name} needs CUDA; toolchain {tc.name} is CPU-only",
                     "remove the kernel, or pick a CUDA toolchain", "kernel-cpu")
        return
    for what, have, allowed in (("python", tc.python, c.python), ("torch", tc.torch_version, c.torch),
                                ("cuda", tc.cuda, c.cuda)):
        if allowed and not SpecifierSet(allowed).contains(Version(have).public if what == "torch" else have,
                                                          prereleases=True):
            problems.add(spec_file, where, f"{k.name} {k.version} needs {what} {allowed}; "
                         f"toolchain {tc.name} has {what} {have}",
                         f"pick a toolchain with {what} {allowed}, or a {k.name} version that supports {have}",
                         f"kernel-{what}")
    for arch in spec.target_archs:
        if c.archs and arch not in c.archs and arch in compat.arch_facts():
            problems.add(spec_file, where, f"{k.name} {k.version} cannot be built for {arch}",
                         f"its archs are {', '.join(c.archs)}; drop {arch} or that kernel", "kernel-arch")
