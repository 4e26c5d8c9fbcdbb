"""What the image's model families need fused, joined with the kernels the image lists.

A family names the functions its layers call through transformers' kernel wrappers (and the
attention it needs); a kernel's `replaces:` in the manifest says what it provides. In an image
with a CUDA toolchain that ships transformers (so the modeling code that would bind the torch
reference is there), a needed function that no listed kernel replaces is refused here, at plan
time: otherwise the image builds, and every job on that family trains on the slow, leaking torch
path. A CPU image has no kernels to ask for; its plan lists such a function as the torch
reference. An image without transformers (a kernels-only proof such as kernel-smoke) ships no
modeling code, so nothing there can fall back.
"""
from __future__ import annotations

from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement

from build.spec import ImageSpec, Kernel, Toolchain
from contracts.schema import Problems
from families import Family

CPU_PATH = "torch reference (CPU image)"
NO_MODELING_CODE = "not bound (the image ships no transformers)"


@dataclass(frozen=True)
class Need:
    family: str
    kind: str           # the layer kind that calls it ("attention" for the attention function)
    function: str       # in the manifest's `replaces:` vocabulary
    provider: str       # the kernel that replaces it, or why none is needed


def ships_transformers(spec: ImageSpec) -> bool:
    for req in spec.python_requirements:
        try:
            if Requirement(req).name.lower() == "transformers":
                return True
        except InvalidRequirement:
            continue
    return False


def needs(families: tuple[Family, ...], kernels: list[Kernel], *, cuda: bool, modeling_code: bool) -> list[Need]:
    """Every (family, layer kind, function) the image's families need, with its provider."""
    found = []
    for family in families:
        wanted = [(kind_name, f.function) for kind_name, kind in family.layer_kinds.items() for f in kind.fused]
        attention_kinds = [name for name, kind in family.layer_kinds.items() if not kind.fused]
        wanted.append((attention_kinds[0] if attention_kinds else "attention", family.attention.replaces))
        for kind_name, function in wanted:
            provider = next((k.name for k in kernels if function in k.replaces), "")
            if not provider:
                provider = "" if cuda and modeling_code else CPU_PATH if not cuda else NO_MODELING_CODE
            found.append(Need(family.name, kind_name, function, provider))
    return found


def check(problems: Problems, spec_file: str, spec: ImageSpec, toolchain: Toolchain, families: tuple[Family, ...],
          kernels: list[Kernel], catalogue: dict[str, Kernel]) -> frozenset[str]:
    """Record a problem per needed function no kernel provides (CUDA images that ship transformers);
    return every function the image's families need (what the plan records per kernel)."""
    cuda = toolchain.cuda != "cpu"
    listed = needs(families, kernels, cuda=cuda, modeling_code=ships_transformers(spec))
    for need in listed:
        if need.provider:
            continue
        where = (f"model_families[{spec.model_families.index(need.family)}]" if spec.model_families
                 else "model_family")
        candidates = sorted(name for name, k in catalogue.items() if need.function in k.replaces)
        fix = (f"add {' or '.join(candidates)} to kernels" if candidates
               else f"add a kernel to kernels_manifest.yaml whose replaces: lists {need.function}")
        problems.add(spec_file, where, f"model family {need.family} needs {need.function} fused (layer kind "
                     f"{need.kind}), and no kernel of this image replaces it: its jobs would train on the torch "
                     "reference, slowly and with packed documents leaking", f"{fix}, or drop {need.family}",
                     "unfused-function")
    for kernel in kernels:
        # a kernel that names nothing it replaces (one a trainer calls itself) is not judged here
        if families and kernel.replaces and not any(r in {n.function for n in listed} for r in kernel.replaces):
            problems.add(spec_file, f"kernels[{spec.kernels.index(kernel.name)}]",
                         f"{kernel.name} provides nothing the image's families use ({', '.join(kernel.replaces)})",
                         f"drop {kernel.name}, or add a family that needs it", "unused-kernel")
    return frozenset(n.function for n in listed)
