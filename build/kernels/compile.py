"""Compile one kernel from its pinned sdist inside a builder container, check it, cache it."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import docker.errors

from build.cache import CacheLayout, link_or_copy, sha256_file
from build.engine import Engine
from build.errors import BuildFailure
from build.kernels.archs import archs_of_wheel
from build.kernels.checks import (CHECK_SCRIPT, CheckRow, arch_rows, fail_on, kernel_check_config, parse_rows,
                                  render_rows, version_rows)
from build.kernels.store import KernelEntry, KernelStore
from build.log import EventLog
from build.context import render_template
from build.resolve import BuildPlan, KernelPlan, digest
from build.sources import fetch_pinned
from build.spec import REPO_ROOT
from build.wheelhouse import requirements_lock, resolve_closure

BUILD_SCRIPT = Path(__file__).resolve().parent / "compile_in_builder.sh"
CCACHE_VOLUME = "ftimage-ccache"
KEY_LABEL = "io.ftimage.kernel-build"


def parallel_jobs(memory_per_job_gb: float) -> int:
    """MAX_JOBS from the memory and cores this host has: nvcc jobs run out of memory long
    before they run out of cores (flash-attention #945, #1038, #1811)."""
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) for line in fh}
        available_gb = info.get("MemAvailable", info.get("MemTotal", 0)) / 2 ** 20
    except OSError:
        available_gb = 8.0
    by_memory = int(available_gb * 0.8 // memory_per_job_gb)
    return max(1, min(os.cpu_count() or 1, by_memory))


def compile_kernel(kernel: KernelPlan, plan: BuildPlan, *, cache: CacheLayout, engine: Engine, log: EventLog,
                   builder_base: str, store: KernelStore) -> KernelEntry:
    """Caller holds store.lock(kernel.key)."""
    _remove_orphan_builds(engine, kernel.key, log)
    sdist = fetch_pinned(kernel.sources[0], cache, log)
    closure = resolve_closure(tuple(plan.toolchain.cuda_pip_toolchain) + kernel.build_requires, plan=plan,
                              cache=cache, log=log, purpose=f"builder for {kernel.name}")
    builder_image = ensure_builder_image(closure, plan, builder_base=builder_base, cache=cache, engine=engine,
                                         log=log)
    staging = store.staging(kernel.key)
    inputs, out = staging / "in", staging / "out"
    try:
        _stage_inputs(inputs, kernel, plan, sdist)
        out.mkdir()
        out.chmod(0o777)
        jobs = parallel_jobs(kernel.memory_per_job_gb)
        env = {**kernel.build_env, "SDIST": sdist.name, "MAX_JOBS": str(jobs), "NVCC_THREADS": "1"}
        log.emit("kernels", f"compiling {kernel.name} {kernel.version} for {','.join(kernel.archs)} in "
                 f"{builder_image}", key=kernel.key[:16], max_jobs=jobs)
        started = time.monotonic()
        result = engine.run(builder_image, ["bash", "/in/compile_in_builder.sh"], network="none",
                            volumes={str(inputs): {"bind": "/in", "mode": "ro"},
                                     str(out): {"bind": "/out", "mode": "rw"},
                                     CCACHE_VOLUME: {"bind": "/ccache", "mode": "rw"}},
                            environment=env, labels={KEY_LABEL: kernel.key}, timeout=6 * 3600)
        duration = time.monotonic() - started
        (staging / "build.log").write_text(result.output)
        if result.exit_code != 0:
            tail = "\n".join(result.output.splitlines()[-30:])
            raise BuildFailure(f"compiling {kernel.name} failed (exit {result.exit_code}); last lines:\n{tail}",
                               "read the compiler error above; the full log was discarded with the failed entry")
        wheels = sorted((out / "dist").glob("*.whl"))
        if len(wheels) != 1:
            raise BuildFailure(f"the {kernel.name} build produced {len(wheels)} wheels, expected 1",
                               "check the package's setup.py output in the build log")
        rows = parse_rows(result.output) or [CheckRow(kernel.name, "in-builder checks", "FAIL",
                                                      "the check script printed no result", "see the build log")]
        observed = json.loads((out / "observed.json").read_text())
        report = archs_of_wheel(wheels[0])
        rows += version_rows(kernel.name, observed, plan) + arch_rows(kernel.name, report, kernel.archs)
        log.emit("kernels", f"checks for {kernel.name}:\n{render_rows(rows)}")
        fail_on(rows, f"the freshly built {kernel.name} wheel is unsound and was NOT cached")
        wheel = wheels[0]
        shutil.move(str(wheel), staging / wheel.name)
        meta = {"kernel": kernel.name, "version": kernel.version, "wheel": wheel.name,
                "sha256": sha256_file(staging / wheel.name), "inputs": kernel.key_inputs, "observed": observed,
                "archs": {"sass": list(report.sass), "ptx": list(report.ptx)},
                "build_log_sha256": hashlib.sha256(result.output.encode()).hexdigest(),
                "duration_s": round(duration, 1), "max_jobs": jobs, "created": int(time.time()),
                "patches": [p.path for p in kernel.patches]}
        shutil.rmtree(inputs)
        shutil.rmtree(out)
        entry = store.publish(kernel.key, staging, meta)
        log.emit("kernels", f"cached {wheel.name} after {duration:.0f}s", key=kernel.key[:16])
        return entry
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_builder_image(closure, plan: BuildPlan, *, builder_base: str, cache: CacheLayout, engine: Engine,
                         log: EventLog) -> str:
    """The builder image for one closure (torch + CUDA toolchain + build deps), built once and
    reused: every compile after the first skips a multi-GB install."""
    tag = f"ftimage-builder/{plan.toolchain.name}:{digest([builder_base, closure.key])[:12]}"
    if engine.image(tag):
        return tag
    log.emit("kernels", f"building the kernel builder image {tag} ({len(closure.wheels)} wheels)")
    context = Path(tempfile.mkdtemp(prefix=".tmp-builder-", dir=cache.scratch))
    try:
        (context / "wheels").mkdir()
        for wheel in closure.wheels:
            link_or_copy(cache.wheel_path(wheel.sha256, wheel.filename), context / "wheels" / wheel.filename)
        (context / "wheels" / "requirements.txt").write_text(requirements_lock(closure.wheels))
        (context / "Dockerfile").write_text(render_template(
            "Dockerfile.builder.j2", builder_base=builder_base, venv="/opt/builder/venv",
            cuda_pip_dir=f"cu{plan.toolchain.cuda.split('.')[0]}", closure_key=closure.key))
        engine.build(context, tag, labels={}, log=log)
    finally:
        shutil.rmtree(context, ignore_errors=True)
    return tag


def _stage_inputs(inputs: Path, kernel: KernelPlan, plan: BuildPlan, sdist: Path) -> None:
    (inputs / "src").mkdir(parents=True)
    link_or_copy(sdist, inputs / "src" / sdist.name)
    (inputs / "patches").mkdir()
    for i, patch in enumerate(kernel.patches):
        shutil.copyfile(REPO_ROOT / patch.path, inputs / "patches" / f"{i:02d}-{Path(patch.path).name}")
    shutil.copyfile(BUILD_SCRIPT, inputs / "compile_in_builder.sh")
    shutil.copyfile(CHECK_SCRIPT, inputs / "check.py")
    (inputs / "check.json").write_text(json.dumps(kernel_check_config(kernel, plan=plan, check_lock=False)))


def _remove_orphan_builds(engine: Engine, key: str, log: EventLog) -> None:
    """A build killed with SIGKILL leaves its container running; we hold the key's lock, so any
    container still labelled with this key is such an orphan."""
    try:
        for container in engine.client.containers.list(all=True, filters={"label": f"{KEY_LABEL}={key}"}):
            log.emit("kernels", f"removing orphaned builder container {container.short_id}")
            container.remove(force=True)
    except docker.errors.APIError:
        pass

