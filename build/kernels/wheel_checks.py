"""GPU-free checks on kernel wheels: in a container (import/ABI, entry points, versions,
Triton's run-time needs) and on the host (SASS/PTX arch coverage). Any FAIL stops the build
with a table naming the kernel, the check and the fix."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from build.errors import BuildFailure
from build.kernels.archs import ArchReport
from contracts.table import render_table

CHECK_SCRIPT = Path(__file__).resolve().parent / "incontainer_check.py"
RESULT_PREFIX = "FTIMAGE-CHECK "


@dataclass(frozen=True)
class CheckRow:
    subject: str
    check: str
    status: str   # PASS / FAIL / INFO
    detail: str
    fix: str = ""


def kernel_check_config(kernel, *, plan, check_lock: bool) -> dict[str, Any]:
    """The JSON the in-container script reads for one plan (and optionally one kernel)."""
    return {"plan_key": plan.plan_key, "torch": plan.toolchain.torch_version, "cuda": plan.toolchain.cuda,
            "cxx11_abi": plan.toolchain.cxx11_abi, "check_lock": check_lock,
            "kernels": [kernel_config(k) for k in ([kernel] if kernel else plan.kernels)]}


def kernel_config(kernel) -> dict[str, Any]:
    return {"name": kernel.name, "kind": kernel.kind, "extension_module": kernel.extension_module,
            "entry_points": {"forward": list(kernel.forward_entry_points),
                             "backward": list(kernel.backward_entry_points),
                             "other": list(kernel.other_entry_points)}}


def parse_rows(output: str) -> list[CheckRow] | None:
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return [CheckRow(**r) for r in json.loads(line[len(RESULT_PREFIX):])]
    return None


def arch_rows(name: str, report: ArchReport, wanted: tuple[str, ...]) -> list[CheckRow]:
    missing = report.missing(wanted)
    rows = [CheckRow(name, "arch coverage (SASS)", "FAIL" if missing else "PASS",
                     f"wanted {','.join(wanted)}; wheel has SASS {','.join(report.sass) or 'none'}"
                     + (f"; PTX {','.join(report.ptx)}" if report.ptx else "; no PTX"),
                     f"the build did not emit {','.join(missing)}: check the kernel's arch_knob in "
                     "kernels_manifest.yaml (the env var its setup.py really reads)" if missing else "")]
    if report.extra(wanted):
        # SASS for archs nobody asked for means the arch knob did not take: the build is not
        # the one the plan describes (and took longer than it should).
        rows.append(CheckRow(name, "no extra archs (SASS)", "FAIL", f"also holds {','.join(report.extra(wanted))}",
                             "the package ignored the arch knob: fix its arch_knob or patch in kernels_manifest.yaml"))
    return rows


def version_rows(name: str, observed: dict[str, str], tc) -> list[CheckRow]:
    """Versions the builder observed while compiling must equal the toolchain's."""
    rows = []
    pairs = [("torch", observed.get("torch", "?"), tc.torch_version),
             ("torch cuda", observed.get("torch_cuda", "?"), tc.cuda),
             ("nvcc", observed.get("nvcc", "?"), tc.cuda),
             ("compiler", observed.get("compiler", "?"), tc.compiler)]
    for what, have, want in pairs:
        ok = have == want or (what == "compiler" and have.startswith(want)) or \
            (what == "torch" and "+" not in want and have.split("+")[0] == want)  # torch.__version__ adds +cu130
        rows.append(CheckRow(name, f"version: {what}", "PASS" if ok else "FAIL", f"built with {have}, lock {want}",
                             "" if ok else "the builder does not match the toolchain; fix the builder base or pins"))
    return rows


def render_rows(rows: list[CheckRow]) -> str:
    return render_table([[r.subject, r.check, r.status, r.detail, r.fix] for r in rows],
                        ["KERNEL", "CHECK", "STATUS", "DETAIL", "FIX"], wrap={3: 70, 4: 60})


def fail_on(rows: list[CheckRow], what: str) -> None:
    failed = [r for r in rows if r.status == "FAIL"]
    if failed:
        raise BuildFailure(f"{what}: {len(failed)} check(s) failed\n{render_rows(rows)}",
                           failed[0].fix or "see the table")
