"""GPU-free checks on kernel wheels: in a container (import/ABI, entry points, versions,
Triton's run-time needs) and on the host (SASS/PTX arch coverage, the wheel's tags, name and
version). Any FAIL stops the build with a table naming the kernel, the check and the fix."""
from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from build.errors import BuildFailure
from build.kernels.archs import ArchReport
from contracts.table import render_table

CHECK_SCRIPT = Path(__file__).resolve().parent / "incontainer_check.py"
RESULT_PREFIX = "FTIMAGE-CHECK "
DIST_INFO_LIMIT = 1 << 20     # a wheel's WHEEL and METADATA are a few KiB


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


def tag_rows(name: str, wheel: str, *, python: str, platform: str | None) -> list[CheckRow]:
    """The wheel file name's tags against the CPython minor (e.g. "3.11") and platform (e.g.
    "linux_x86_64", or None: not checked) it was built for. A compiled extension is tagged
    cpXY-cpXY (or cp3N-abi3 with N <= Y) and its platform is the key's, or a manylinux tag of
    the same machine. Every tag of a compressed tag set must pass: each is a claim pip acts on."""
    try:
        tags = parse_wheel_filename(wheel)[3]
    except InvalidWheelFilename:
        return [CheckRow(name, "wheel tags", "FAIL", f"{wheel} is not a wheel file name",
                         "rebuild the wheel with pip")]
    major, _, minor = python.partition(".")
    cp = f"cp{major}{minor}"

    def python_ok(tag) -> bool:
        older = re.fullmatch(rf"cp{major}(\d+)", tag.interpreter)
        return tag.interpreter == cp or (tag.abi == "abi3" and older is not None and
                                         minor.isdigit() and int(older.group(1)) <= int(minor))

    machine = (platform or "").removeprefix("linux_")
    checks = [("python", python_ok, f"CPython {python} ({cp})"),
              ("abi", lambda t: t.abi in (cp, "abi3"), f"{cp} or abi3")]
    if platform is not None:
        checks.append(("platform", lambda t: t.platform == platform or re.fullmatch(
            rf"manylinux(1|2010|2014|_\d+_\d+)_{re.escape(machine)}", t.platform) is not None, platform))
    shown = ".".join(sorted(str(t) for t in tags))
    return [CheckRow(name, f"wheel tag: {what}", "PASS" if all(ok(t) for t in tags) else "FAIL",
                     f"{wheel} is tagged {shown}; wanted {want}",
                     "" if all(ok(t) for t in tags) else
                     f"the wheel was not built for {want}: rebuild it with the key's toolchain")
            for what, ok, want in checks]


def wheel_content_rows(kernel, wheel: str, report: ArchReport, *, python: str, platform: str | None) -> list[CheckRow]:
    """What a wheel built from an sdist holds, by the kernel's kind: a compiled kernel's SASS for
    exactly its target archs and its CPython/platform tags; a Triton kernel's wheel no GPU code at
    all and the pure-Python tag (Triton compiles its kernels at run time, for the GPU it finds)."""
    if kernel.compiled:
        return arch_rows(kernel.name, report, kernel.archs) + tag_rows(kernel.name, wheel, python=python,
                                                                       platform=platform)
    return pure_rows(kernel.name, wheel, report)


def pure_rows(name: str, wheel: str, report: ArchReport) -> list[CheckRow]:
    """A Triton kernel's wheel built from its sdist: no SASS or PTX, tagged py3-none-any. Either
    failing means the package compiled its CUDA extension after all (its skip knob did not take)."""
    fix = f"the build compiled an extension: set the package's skip-CUDA knob in {name}'s build_env"
    gpu_code = [*report.sass, *(f"PTX {a}" for a in report.ptx)]
    rows = [CheckRow(name, "pure Python (no GPU code)", "FAIL" if gpu_code else "PASS",
                     f"holds {', '.join(gpu_code)}" if gpu_code else "no SASS or PTX (Triton compiles at run time)",
                     fix if gpu_code else "")]
    try:
        tags = parse_wheel_filename(wheel)[3]
    except InvalidWheelFilename:
        return rows + [CheckRow(name, "wheel tag: pure", "FAIL", f"{wheel} is not a wheel file name",
                                "rebuild the wheel with pip")]
    pure = all(re.fullmatch(r"py3\d*", t.interpreter) and t.abi == "none" and t.platform == "any" for t in tags)
    shown = ".".join(sorted(str(t) for t in tags))
    return rows + [CheckRow(name, "wheel tag: pure", "PASS" if pure else "FAIL",
                            f"{wheel} is tagged {shown}; wanted py3-none-any", "" if pure else fix)]


def dist_info_rows(name: str, wheel: Path) -> list[CheckRow]:
    """What the wheel says of itself (its .dist-info WHEEL and METADATA) against its file name:
    the tags, name and version the file name claims must be the ones it holds."""
    fix = "the wheel's file name is not the wheel: rebuild it with pip"
    try:
        dist, version, _build, tags = parse_wheel_filename(wheel.name)
        with zipfile.ZipFile(wheel) as zf:
            infos = sorted({n.split("/")[0] for n in zf.namelist()
                            if re.fullmatch(r"[^/]+\.dist-info/(WHEEL|METADATA)", n)})
            if len(infos) != 1:
                return [CheckRow(name, "wheel dist-info", "FAIL", f"{wheel.name} holds {len(infos)} .dist-info "
                                 "folders with WHEEL and METADATA, expected 1", fix)]
            headers = {}
            for part in ("WHEEL", "METADATA"):
                info = zf.getinfo(f"{infos[0]}/{part}")
                if info.file_size > DIST_INFO_LIMIT:     # read before anything proved the wheel sound
                    raise ValueError(f"its {part} claims {info.file_size} bytes")
                headers[part] = HeaderParser().parsestr(zf.read(info).decode("utf-8", "replace"))
    except (InvalidWheelFilename, zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as exc:
        return [CheckRow(name, "wheel dist-info", "FAIL", f"{wheel.name} cannot be read: {exc}", fix)]
    held, named = sorted(headers["WHEEL"].get_all("Tag") or []), sorted(str(t) for t in tags)
    said_name, said_version = headers["METADATA"].get("Name", ""), headers["METADATA"].get("Version", "")
    try:
        same = canonicalize_name(said_name) == dist and str(Version(said_version)) == str(version)
    except InvalidVersion:
        same = False
    return [CheckRow(name, "wheel dist-info: tags", "PASS" if held == named else "FAIL",
                     f"WHEEL says {','.join(held)[:200] or 'no tag'}; the file name {','.join(named)}",
                     "" if held == named else fix),
            CheckRow(name, "wheel dist-info: name and version", "PASS" if same else "FAIL",
                     f"METADATA says {said_name[:60]} {said_version[:40]}; the file name {dist} {version}",
                     "" if same else fix)]


def render_rows(rows: list[CheckRow]) -> str:
    return render_table([[r.subject, r.check, r.status, r.detail, r.fix] for r in rows],
                        ["KERNEL", "CHECK", "STATUS", "DETAIL", "FIX"], wrap={3: 70, 4: 60})


def fail_on(rows: list[CheckRow], what: str) -> None:
    failed = [r for r in rows if r.status == "FAIL"]
    if failed:
        raise BuildFailure(f"{what}: {len(failed)} check(s) failed\n{render_rows(rows)}",
                           failed[0].fix or "see the table")
