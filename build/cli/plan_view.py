"""Human-readable rendering of a BuildPlan (the JSON form is BuildPlan.to_json)."""
from __future__ import annotations

from build.resolve import BuildPlan, family_needs
from contracts.table import render_table
from families import load_family


def specialisation_text(kernel, *, short: bool = False) -> str:
    s = kernel.specialisation
    if s.generic:
        return "generic" if kernel.compiled else "-"
    dims = [f"head dims {', '.join(map(str, s.head_dims))}"] if s.head_dims else []
    if short:
        return ", ".join(([f"hdim {','.join(map(str, s.head_dims))}"] if s.head_dims else []) + [",".join(s.dtypes)])
    parts = dims + [f"dtypes {', '.join(s.dtypes)}"]
    if s.disabled:
        parts.append(f"compiled without {', '.join(s.disabled)}")
    return f"for {s.family}: " + "; ".join(parts)


def render_plan(plan: BuildPlan, kernel_status: dict[str, tuple[str, str]] | None = None) -> str:
    """kernel_status: kernel key -> (cache state, expected compile cost), filled by build/kernels."""
    tc = plan.toolchain
    spec = plan.spec
    out = [
        f"image      {spec.name}  ->  tag {plan.tag}",
        f"plan key   {plan.plan_key}",
        f"toolchain  {tc.name}: python {tc.python}, torch {tc.torch_version}, cuda {tc.cuda}, "
        f"cxx11_abi {tc.cxx11_abi}, {tc.compiler}",
        f"torch      {plan.torch_wheel.filename}  sha256 {plan.torch_wheel.sha256[:16]}...",
        f"archs      {', '.join(spec.target_archs) or '(none: CPU image)'}",
        f"bases      builder {spec.builder_base.describe()}, runtime {spec.runtime_base.describe()}",
        f"runtime    user {spec.user.name} (uid {spec.user.uid}, gid {spec.gid}), "
        f"attention {spec.attn_implementation}, model "
        f"{'families' if len(spec.families) > 1 else 'family'} {', '.join(spec.families)}",
        "kernels    " + ("specialised to the model family" if spec.specialise_kernels
                            else "generic (specialise_kernels: false)"),
        f"python     {len(plan.python_requirements)} pinned requirements: {', '.join(plan.python_requirements)}",
        "",
    ]
    out += [family_table(plan), ""]
    if not plan.kernels:
        out.append("kernels    (none)")
        return "\n".join(out)
    rows = []
    for k in plan.kernels:
        state, cost = (kernel_status or {}).get(k.key, ("-", "-"))
        rows.append([k.name, k.version, k.kind, k.key[:16], ",".join(k.archs) or "-", state, cost,
                     specialisation_text(k, short=True), ", ".join(k.replaces)])
    out.append(render_table(rows, ["KERNEL", "VERSION", "KIND", "KEY", "ARCHS", "CACHE", "COMPILE COST",
                                   "SPECIALISED", "REPLACES"], wrap={6: 40}))
    out.append("")
    for k in plan.kernels:
        if k.compiled:
            sources = f"; {k.estimate.sources} sources to compile" if k.estimate else ""
            out.append(f"specialise {k.name}: {specialisation_text(k)}{sources}")
    for k in plan.kernels:
        if k.build_env:
            out.append(f"build env  {k.name}: " + " ".join(f"{e}={v}" for e, v in sorted(k.build_env.items())))
    return "\n".join(out)


def family_table(plan: BuildPlan) -> str:
    """Per family: each fused function its layers need and the kernel of this image that provides
    it (resolve refused a CUDA image where none does)."""
    families = tuple(load_family(name) for name in plan.spec.families)
    kernels = [_Provides(k.name, k.replaces) for k in plan.kernels]
    cuda = plan.toolchain.cuda != "cpu"
    rows = [[n.family, n.kind, n.function, n.provider]
            for n in family_needs.needs(families, kernels, cuda=cuda,
                                        modeling_code=family_needs.ships_transformers(plan.spec))]
    return render_table(rows, ["FAMILY", "LAYER KIND", "FUSED FUNCTION", "PROVIDED BY"])


class _Provides:
    """The two facts family_needs reads from a kernel, taken from the plan (what it records)."""

    def __init__(self, name: str, replaces: tuple[str, ...]):
        self.name, self.replaces = name, replaces
