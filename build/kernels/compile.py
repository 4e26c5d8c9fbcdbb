"""Compile one kernel from its pinned sdist inside a builder container, check it, cache it.

The container runs recipe.py (the same recipe `kernels build-here` runs on a host) with
networking disabled; its output streams back line by line, so ninja's progress shows as
it happens. A Triton kernel pinned by its sdist (PyPI has no wheel of it) goes the same way:
its wheel is pure Python, built from the patched sdist with nothing compiled.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from build.cache import CacheLayout, UnsafeFile, copy_nofollow, link_or_copy, sha256_file
from build.engine import Engine
from build.errors import BuildFailure
from build.kernels.archs import archs_of_wheel
from build.kernels.pinned_sources import fetch_pinned
from build.kernels.progress import CompileProgress
from build.kernels.store import KernelEntry, KernelStore
from build.kernels.wheel_checks import (
    CHECK_SCRIPT,
    CheckRow,
    dist_info_rows,
    fail_on,
    kernel_check_config,
    parse_rows,
    render_rows,
    version_rows,
    wheel_content_rows,
)
from build.resolve import BuildPlan, KernelPlan, digest
from build.spec import REPO_ROOT
from build.templating import render_template
from build.wheelhouse import Resolution, Wheel, requirements_lock, resolve_closure
from contracts.events import EventLog

RECIPE = Path(__file__).resolve().parent / "recipe.py"
CCACHE_VOLUME = "ftimage-ccache"
KEY_LABEL = "io.ftimage.kernel-build"
BUILDER_LABEL = "io.ftimage.builder.closure"


def built_from_sdist(kernel: KernelPlan) -> bool:
    """A kernel this build makes from its pinned sdist: every compiled kernel, and a Triton kernel
    pinned by its sdist (a pure-Python wheel, made by the same recipe). A Triton kernel pinned by
    its wheels is only fetched."""
    return kernel.compiled or any(not s.filename.endswith(".whl") for s in kernel.sources)


def unkeyed_inputs(kernel: KernelPlan) -> dict[str, Any] | None:
    """What a kernel built from its sdist is made from that its key does not cover; None when the
    key covers it all. A Triton kernel's key holds only its sources (build/resolve keeps it free of
    the toolchain), so one built from a patched sdist records its patches, knobs and build
    requirements in meta.json, and a cache entry made from others is stale, not a hit."""
    if not built_from_sdist(kernel) or "patches" in kernel.key_inputs:
        return None
    return {"patches": [p.sha256 for p in kernel.patches], "build_env": dict(sorted(kernel.build_env.items())),
            "build_requires": list(kernel.build_requires)}


def parallel_jobs(memory_per_job_gb: float, *, cores: int | None = None) -> int:
    """MAX_JOBS from the memory and cores this host has: nvcc jobs run out of memory long
    before they run out of cores (flash-attention #945, #1038, #1811). FTIMAGE_MEMORY_GB
    overrides the reading, for machines whose memory grows on demand (VMs that start small)."""
    override = os.environ.get("FTIMAGE_MEMORY_GB", "")
    try:
        if override:
            available_gb = float(override)
        else:
            with open("/proc/meminfo") as fh:
                info = {line.split(":")[0]: int(line.split()[1]) for line in fh}
            available_gb = info.get("MemAvailable", info.get("MemTotal", 0)) / 2 ** 20
    except (OSError, ValueError, IndexError):
        available_gb = 8.0
    by_memory = int(available_gb * 0.8 // memory_per_job_gb)
    return max(1, min(cores or os.cpu_count() or 1, by_memory))


def stage_inputs(inputs: Path, kernel: KernelPlan, sdist: Path) -> None:
    """What the recipe reads: the sdist, the applicable patches in order, the scripts. Spec
    validation checked each patch, but the file may have changed since: what is staged is the
    file itself (never a link) and exactly the bytes the manifest pins, hashed as they are copied."""
    (inputs / "src").mkdir(parents=True)
    link_or_copy(sdist, inputs / "src" / sdist.name)
    (inputs / "patches").mkdir()
    for i, patch in enumerate(kernel.patches):
        try:
            copy_nofollow(REPO_ROOT / patch.path, inputs / "patches" / f"{i:02d}-{Path(patch.path).name}",
                          sha256=patch.sha256)
        except UnsafeFile as exc:
            raise BuildFailure(f"the patch {patch.path} of {kernel.name} is not the file the manifest pins: "
                               f"{exc}", f"restore {patch.path} from git, or re-pin its sha256 in "
                               "kernels_manifest.yaml after reviewing the change") from None
    shutil.copyfile(RECIPE, inputs / "recipe.py")
    shutil.copyfile(CHECK_SCRIPT, inputs / "check.py")


def compile_kernel(kernel: KernelPlan, plan: BuildPlan, *, cache: CacheLayout, engine: Engine, log: EventLog,
                   builder_base: str, store: KernelStore) -> KernelEntry:
    """Caller holds store.lock(kernel.key)."""
    removed = engine.remove_containers(f"{KEY_LABEL}={kernel.key}")
    if removed:  # we hold the key's lock, so a container with this key is a killed build's orphan
        log.emit("kernels", f"removed {removed} orphaned builder container(s)", step=kernel.name)
    sdist = fetch_pinned(kernel.sources[0], cache, log)
    builder_image, build_requires = builder_for(kernel, plan, builder_base=builder_base, cache=cache,
                                                engine=engine, log=log)
    staging = store.staging(kernel.key)
    inputs, out = staging / "in", staging / "out"
    try:
        stage_inputs(inputs, kernel, sdist)
        if build_requires:
            stage_wheels(inputs / "build-requires", build_requires, cache)
        out.mkdir()
        out.chmod(0o777)
        jobs = parallel_jobs(kernel.memory_per_job_gb)
        check_config = json.dumps(kernel_check_config(kernel, plan=plan, check_lock=False))
        command = ["python", "/in/recipe.py", "--sdist", f"/in/src/{sdist.name}", "--patches", "/in/patches",
                   "--out", "/out", "--work", "/tmp/work", "--jobs", str(jobs), "--ccache", "/ccache",
                   "--check-script", "/in/check.py", "--check-config", check_config]
        if build_requires:
            command += ["--build-requires", "/in/build-requires"]
        for key, value in sorted(kernel.build_env.items()):
            command += ["--env", f"{key}={value}"]
        expected = kernel.estimate.wall_seconds(jobs) if kernel.estimate else None
        progress = CompileProgress(log, kernel.name, expected_seconds=expected)
        log.emit("compile", f"{kernel.name} {kernel.version} for {','.join(kernel.archs)} in {builder_image} "
                 f"with {jobs} job(s)", step=kernel.name, eta=expected)
        started = time.monotonic()
        result = engine.run(builder_image, command, network="none",
                            volumes={str(inputs): {"bind": "/in", "mode": "ro"},
                                     str(out): {"bind": "/out", "mode": "rw"},
                                     CCACHE_VOLUME: {"bind": "/ccache", "mode": "rw"}},
                            environment={"HOME": "/tmp"}, labels={KEY_LABEL: kernel.key}, timeout=6 * 3600,
                            on_output=progress.feed)
        duration = time.monotonic() - started
        if result.exit_code != 0:
            tail = "\n".join(result.output.splitlines()[-30:])
            raise BuildFailure(f"compiling {kernel.name} failed (exit {result.exit_code}); last lines:\n{tail}",
                               "read the compiler error above; nothing was cached")
        progress.finish(f"compiled in {duration:.0f}s")
        entry = check_and_publish(kernel, plan.toolchain, out, result.output, duration, jobs, staging, store, log)
        return entry
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_and_publish(kernel: KernelPlan, toolchain, out: Path, output: str, duration: float, jobs: int,
                      staging: Path, store: KernelStore, log: EventLog) -> KernelEntry:
    """The GPU-free checks on a freshly built wheel; only a sound wheel enters the cache."""
    wheels = sorted((out / "dist").glob("*.whl"))
    if len(wheels) != 1:
        raise BuildFailure(f"the {kernel.name} build produced {len(wheels)} wheels, expected 1",
                           "check the package's setup.py output in the build log")
    rows = parse_rows(output) or [CheckRow(kernel.name, "in-builder checks", "FAIL",
                                           "the check script printed no result", "see the build log")]
    observed = json.loads((out / "observed.json").read_text())
    report = archs_of_wheel(wheels[0])
    rows += version_rows(kernel.name, observed, toolchain)
    rows += wheel_content_rows(kernel, wheels[0].name, report, python=toolchain.python,
                               platform=kernel.key_inputs.get("platform"))
    rows += dist_info_rows(kernel.name, wheels[0])
    log.emit("check", f"checks for {kernel.name}:\n{render_rows(rows)}", step=kernel.name)
    fail_on(rows, f"the freshly built {kernel.name} wheel is unsound and was NOT cached")
    wheel = wheels[0]
    shutil.move(str(wheel), staging / wheel.name)
    meta = entry_meta(kernel, staging / wheel.name, observed, report.sass, report.ptx, output.encode(), duration,
                      jobs)
    for leftover in ("in", "out"):
        shutil.rmtree(staging / leftover, ignore_errors=True)
    (staging / "build.log").write_text(output)
    entry = store.publish(kernel.key, staging, meta)
    log.emit("kernels", f"cached {wheel.name} after {duration:.0f}s", step=kernel.name)
    return entry


def entry_meta(kernel: KernelPlan, wheel: Path, observed: dict, sass, ptx, build_log: bytes, duration: float,
               jobs: int) -> dict:
    """A kernel cache entry's meta.json: what the wheel is (its sha256, its SASS and PTX), what it
    was built from (the key's inputs, the patches), what the recipe saw, and its build log's digest."""
    meta = {"kernel": kernel.name, "version": kernel.version, "wheel": wheel.name, "sha256": sha256_file(wheel),
            "inputs": kernel.key_inputs, "observed": observed, "archs": {"sass": list(sass), "ptx": list(ptx)},
            "build_log_sha256": hashlib.sha256(build_log).hexdigest(), "duration_s": round(duration, 1),
            "max_jobs": jobs, "created": int(time.time()), "patches": [p.path for p in kernel.patches]}
    built_from = unkeyed_inputs(kernel)
    if built_from is not None:
        meta["built_from"] = built_from
    return meta


def builder_for(kernel: KernelPlan, plan: BuildPlan, *, builder_base: str, cache: CacheLayout, engine: Engine,
                log: EventLog) -> tuple[str, tuple[Wheel, ...]]:
    """The builder image a kernel compiles in, and the wheels its compile installs on top.

    The image holds the toolchain's closure only (torch and NVIDIA's CUDA toolchain, a
    multi-GB install), so every kernel of every plan on this toolchain shares it; each
    kernel's few build requirements are installed in its compile container. When resolving
    them beside the toolchain picks another version of a toolchain package, the kernel gets
    an image of its own closure instead: it never compiles against anything but its pins."""
    toolchain = tuple(plan.toolchain.cuda_pip_toolchain)
    shared = resolve_closure(toolchain, plan=plan, cache=cache, log=log, purpose=f"{plan.toolchain.name} builder")
    closure = resolve_closure(toolchain + kernel.build_requires, plan=plan, cache=cache, log=log,
                              purpose=f"build requirements of {kernel.name}")
    on_top = wheels_on_top(shared.wheels, closure.wheels)
    if on_top is None:
        log.emit("kernels", f"{kernel.name}'s build requirements change a toolchain package: it gets its own builder",
                 step=kernel.name)
        shared, on_top = closure, ()
    return ensure_builder_image(shared, plan, builder_base=builder_base, cache=cache, engine=engine, log=log), on_top


def wheels_on_top(base: tuple[Wheel, ...], closure: tuple[Wheel, ...]) -> tuple[Wheel, ...] | None:
    """The wheels of `closure` missing from `base`, or None when `closure` holds another build
    of a wheel `base` has (installing it on top would replace part of the toolchain)."""
    in_closure = {w.name: w.sha256 for w in closure}
    if any(in_closure.get(w.name) != w.sha256 for w in base):
        return None
    held = {w.name for w in base}
    return tuple(sorted((w for w in closure if w.name not in held), key=lambda w: w.name))


def stage_wheels(folder: Path, wheels: tuple[Wheel, ...], cache: CacheLayout) -> None:
    """Hash-locked wheels from the cache and their requirements.txt, as `pip install --require-hashes` reads them."""
    folder.mkdir(parents=True)
    for wheel in wheels:
        link_or_copy(cache.wheel_path(wheel.sha256, wheel.filename), folder / wheel.filename)
    (folder / "requirements.txt").write_text(requirements_lock(wheels))


def ensure_builder_image(closure: Resolution, plan: BuildPlan, *, builder_base: str, cache: CacheLayout,
                         engine: Engine, log: EventLog) -> str:
    """The builder image for one closure (torch + the CUDA toolchain), built once and reused:
    every compile after the first skips a multi-GB install."""
    tag = f"ftimage-builder/{plan.toolchain.name}:{digest([builder_base, closure.key])[:12]}"
    if engine.image(tag):
        return tag
    log.emit("kernels", f"building the kernel builder image {tag} ({len(closure.wheels)} wheels)")
    with cache.scratch_dir("builder") as context:
        stage_wheels(context / "wheels", closure.wheels, cache)
        (context / "Dockerfile").write_text(render_template(
            "Dockerfile.builder.j2", builder_base=builder_base, venv="/opt/builder/venv",
            cuda_pip_dir=f"cu{plan.toolchain.cuda.split('.')[0]}"))
        engine.build(context, tag, labels={BUILDER_LABEL: closure.key, "io.ftimage.builder.toolchain":
                                           plan.toolchain.name}, log=log)
    return tag
