"""Human-readable rendering of a BuildPlan (the JSON form is BuildPlan.to_json)."""
from __future__ import annotations

from build.resolve import BuildPlan


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render_plan(plan: BuildPlan, kernel_status: dict[str, tuple[str, str]] | None = None) -> str:
    """kernel_status: kernel key -> (cache state, expected compile cost), filled by build/kernels."""
    tc = plan.toolchain
    out = [
        f"image      {plan.spec.name}  ->  tag {plan.tag}",
        f"plan key   {plan.plan_key}",
        f"toolchain  {tc.name}: python {tc.python}, torch {tc.torch_version}, cuda {tc.cuda}, "
        f"cxx11_abi {tc.cxx11_abi}, {tc.compiler}",
        f"torch      {plan.torch_wheel.filename}  sha256 {plan.torch_wheel.sha256[:16]}...",
        f"archs      {', '.join(plan.spec.target_archs) or '(none: CPU image)'}",
        f"bases      builder {plan.spec.builder_base.describe()}, runtime {plan.spec.runtime_base.describe()}",
        f"runtime    user {plan.spec.user.name} (uid {plan.spec.user.uid}), "
        f"attention {plan.spec.attn_implementation}, model family {plan.spec.model_family}",
        f"python     {len(plan.python_requirements)} pinned requirements: {', '.join(plan.python_requirements)}",
        "",
    ]
    if not plan.kernels:
        out.append("kernels    (none)")
    else:
        rows = []
        for k in plan.kernels:
            state, cost = (kernel_status or {}).get(k.key, ("-", "-"))
            knob = ", ".join(f"{e}={v}" for e, v in sorted(k.build_env.items())) or "-"
            rows.append([k.name, k.version, k.kind, k.key[:16], ",".join(k.archs) or "-", state, cost,
                         ", ".join(k.replaces), knob])
        out.append(table(rows, ["KERNEL", "VERSION", "KIND", "KEY", "ARCHS", "CACHE", "COMPILE COST",
                                "REPLACES", "BUILD ENV"]))
    return "\n".join(out)
