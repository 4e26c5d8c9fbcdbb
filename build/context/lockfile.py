"""The build lock for a plan: what the image (or a GPU host, for `kernels build-here`) holds.
Its format is contracts.lock, the one definition verify/ and entrypoint/ read."""
from __future__ import annotations

from typing import TYPE_CHECKING

from build.resolve import BuildPlan
from build.wheelhouse import Wheel
from contracts.lock import BuildLock, LockedKernel, LockedPackage

if TYPE_CHECKING:   # the wheel type only, for annotations: kernels/build_here.py makes locks with
    # this folder, so a runtime import back into kernels/ would close a cycle
    from build.kernels.wheel import KernelWheel


def locked_kernels(plan: BuildPlan, kernel_wheels: tuple[KernelWheel, ...]) -> tuple[LockedKernel, ...]:
    """One entry per installed wheel, named by the distribution that wheel installs: a kernel
    shipped as several wheels (flash-linear-attention + fla-core) gets one entry each, so
    verify hashes every installed file of each against its RECORD."""
    by_kernel: dict[str, list[KernelWheel]] = {}
    for kw in kernel_wheels:
        by_kernel.setdefault(kw.name, []).append(kw)
    out = []
    for k in plan.kernels:
        for kw in sorted(by_kernel.get(k.name, []), key=lambda w: w.filename):
            out.append(LockedKernel(
                name=k.name, distribution=kw.distribution, version=kw.version, kind=k.kind,
                import_name=k.import_name, key=k.key, wheel=kw.filename, sha256=kw.sha256,
                extension_module=k.extension_module, entry_points=k.entry_points, replaces=k.replaces,
                python_api=dict(k.python_api), profile_kernels=dict(k.profile_kernels), archs=kw.archs,
                specialisation=k.specialisation, runtime_constraints=k.runtime_constraints))
    return tuple(out)


def make_lock(plan: BuildPlan, wheels: tuple[Wheel, ...], kernel_wheels: tuple[KernelWheel, ...],
              base_ids: dict[str, str], *, packages: tuple[LockedPackage, ...] | None = None,
              transformers: str = "", build: dict[str, str] | None = None) -> BuildLock:
    """`build`: how the build was made where it bears on trust (BuildLock.build), e.g. the remote
    cache's `{"remote_cache_trust": "unsigned"}`; empty for most builds, and then not written."""
    kernel_files = {kw.filename for kw in kernel_wheels}
    if packages is None:
        packages = tuple(LockedPackage(name=w.name, version=w.version, filename=w.filename, sha256=w.sha256)
                         for w in sorted(wheels, key=lambda w: w.name) if w.filename not in kernel_files)
    transformers = transformers or next((p.version for p in packages if p.name == "transformers"), "")
    tc = plan.toolchain
    # the version torch's distribution metadata reports, which is what verify compares with
    # (torch.__version__ adds a local label, +cu130, that the metadata of PyTorch's wheel lacks)
    torch_version = next((w.version for w in wheels if w.name == "torch"), "") or \
        next((p.version for p in packages if p.name == "torch"), "") or tc.torch_version
    return BuildLock(image=plan.spec.name, plan_key=plan.plan_key, python=tc.python, torch=torch_version,
                     cuda=tc.cuda, cxx11_abi=tc.cxx11_abi, compiler=tc.compiler, transformers=transformers,
                     model_family=plan.spec.families[0],
                     model_families=plan.spec.model_families, target_archs=plan.spec.target_archs,
                     attn_implementation=plan.spec.attn_implementation,
                     kernels=locked_kernels(plan, kernel_wheels), packages=packages,
                     base_images=dict(sorted(base_ids.items())), finetune_defaults=plan.spec.finetune_defaults,
                     build=dict(sorted((build or {}).items())))
