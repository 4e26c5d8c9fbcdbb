"""Model-aware kernel specialisation: derive each kernel's compile set from the image's model
family and the knobs the manifest says can trim the kernel.

A Qwen3.5 hybrid trains in bf16 and runs flash-attn at one head dim (256), causal, varlen,
with no dropout, ALiBi, softcap or sliding window: 6 of flash-attn's 72 sources plus
flash_api.cpp, each compiled with upstream's DISABLE_* defines; and causal-conv1d for
(bf16 input, bf16 weight) only, 1 of its 9 dtype pairs. The family states those facts
(families/<name>.yaml); the manifest states the knobs (kernels.<k>.specialise); this module
joins the two.
"""
from __future__ import annotations

from build.resolve.build_plan import CompileEstimate
from build.spec import ImageSpec, Kernel
from contracts.lock import Specialisation
from contracts.schema import Problems
from families import Family

DTYPE_OF_PARAM = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def head_dim_is_even(head_dim: int) -> bool:
    """flash-attn pads a head dim up to its kernel's size (32, 64, ..., 256); one that needs no
    padding is "even K", and the uneven-K code paths can be compiled out."""
    return head_dim % 32 == 0 and head_dim <= 256


def specialise(kernel: Kernel, spec: ImageSpec, families: tuple[Family, ...], problems: Problems,
               spec_file: str) -> tuple[Specialisation, dict[str, str]]:
    """(what the kernel is trimmed to, the env knobs that do it): the union of what the image's
    families need (every head dim, dtype and attention feature any of them uses). Generic when
    the kernel has no knobs, the image opts out (specialise_kernels: false) or a family is unknown."""
    knobs = kernel.specialise
    if knobs is None or not spec.specialise_kernels or not families:
        return Specialisation(), {}
    if knobs.serves and spec.attn_implementation not in knobs.serves:
        problems.add(spec_file, "runtime.attn_implementation",
                     f"{kernel.name} is specialised for {', '.join(knobs.serves)}, but the image runs "
                     f"{spec.attn_implementation}: nothing would call the kernel",
                     f"set runtime.attn_implementation: {knobs.serves[0]}, or drop {kernel.name} from kernels",
                     "specialise-conflict")
        return Specialisation(), {}
    ok = all([_dtypes_fit(kernel, spec, family, problems, spec_file, f"families/{family.name}.yaml")
              for family in families])
    all_head_dims = sorted({d for family in families for d in family.attention.head_dims})
    head_dims: tuple[int, ...] = ()
    if knobs.head_dims is not None:
        head_dims = tuple(all_head_dims)
        for family in families:
            for i, head_dim in enumerate(family.attention.head_dims):
                if str(head_dim) not in knobs.head_dims.supported:
                    problems.add(f"families/{family.name}.yaml", f"attention.head_dims[{i}]",
                                 f"{kernel.name} {kernel.version} has no kernel for head dim {head_dim} "
                                 f"(it has {', '.join(knobs.head_dims.supported)})",
                                 f"fix the family's head dims, or set specialise_kernels: false in {spec_file} "
                                 "if the model needs a kernel this package cannot build", "unsupported-head-dim")
                    ok = False
    if not ok:
        return Specialisation(), {}
    sep = knobs.separator
    dtypes = tuple(sorted({d for family in families for d in family.dtypes}))
    env = {knobs.dtypes.env: sep.join(dtypes)}
    if knobs.head_dims is not None:
        env[knobs.head_dims.env] = sep.join(str(d) for d in head_dims)
    disabled: tuple[str, ...] = ()
    if knobs.disable is not None:
        used = {f for family in families for f in family.attention.features.used()}
        if not all(head_dim_is_even(d) for d in all_head_dims):
            used.add("uneven_head_dim")
        disabled = tuple(f for f in knobs.disable.features if f not in used)
        env[knobs.disable.env] = sep.join(knobs.disable.features[f] for f in disabled)
    return Specialisation(head_dims=head_dims, dtypes=dtypes, disabled=disabled,
                          family=", ".join(f.name for f in families)), env


def _dtypes_fit(kernel: Kernel, spec: ImageSpec, family: Family, problems: Problems, spec_file: str,
                family_file: str) -> bool:
    ok = True
    for i, dtype in enumerate(family.dtypes):
        if dtype not in kernel.specialise.dtypes.supported:
            problems.add(family_file, f"dtypes[{i}]", f"{kernel.name} has no {dtype} kernels",
                         f"use one of: {', '.join(kernel.specialise.dtypes.supported)}", "unsupported-dtype")
            ok = False
    param_dtype = (spec.finetune_defaults.get("parallel") or {}).get("param_dtype", "bfloat16")
    wanted = DTYPE_OF_PARAM.get(param_dtype)
    if wanted and wanted not in family.dtypes:
        where = "parallel.param_dtype"
        problems.add(spec_file, f"finetune.defaults.{where}",
                     f"the image trains in {param_dtype}, but {kernel.name} would be compiled for "
                     f"{', '.join(family.dtypes)} only (what model family {family.name} trains in)",
                     f"set {where}: {'bfloat16' if 'bf16' in family.dtypes else 'float16'}, or "
                     "specialise_kernels: false", "specialise-conflict")
        ok = False
    return ok


def estimate(kernel: Kernel, specialisation: Specialisation, n_archs: int) -> CompileEstimate | None:
    cost = kernel.compile_cost
    if cost is None or kernel.kind != "cuda-extension":
        return None
    sources, per_source = cost.sources, cost.cpu_seconds_per_source
    if kernel.specialise is not None and not specialisation.generic:
        knobs = kernel.specialise
        if knobs.sources_per_combination:
            sources = (max(1, len(specialisation.head_dims)) * len(specialisation.dtypes)
                       * knobs.sources_per_combination + knobs.extra_sources)
        per_source = cost.cpu_seconds_per_source_specialised or per_source
    return CompileEstimate(sources=sources, cpu_seconds=round(sources * per_source * max(1, n_archs), 1))
