"""`python -m build kernels build-here IMAGE_DIR`: compile and check an image's kernels on THIS
machine, without Docker, for its own Python, torch and GPU arch.

It runs the same recipe (recipe.py) with the same pinned sdists, patches, knobs and
specialisation as an image build, and the same GPU-free checks; only the toolchain is the
one installed here instead of the pinned one. Used to prove the kernels on a bare GPU host
(bench/gpu_proof), where the image's own toolchain (another Python) cannot run.

Each kernel is looked up as an image build looks it up: the local kernel cache, then the
remote cache (`--cache-registry`, verified as for a build), then compiled; a sound wheel
compiled here enters the local cache and, with a remote cache that is written, the registry.
Its key is this host's own (the torch installed here is one of its inputs), so an entry made
here never stands in for an image's.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from build import proc
from build.cache import CacheLayout, sha256_file
from build.context.lockfile import make_lock
from build.errors import BuildFailure
from build.kernels.acceptance import Expected
from build.kernels.archs import archs_of_wheel
from build.kernels.compile import RECIPE, built_from_sdist, entry_meta, parallel_jobs, stage_inputs, unkeyed_inputs
from build.kernels.pinned_sources import fetch_pinned
from build.kernels.progress import CompileProgress
from build.kernels.store import KernelEntry, KernelStore
from build.kernels.wheel import KernelWheel
from build.kernels.wheel_checks import (
    CheckRow,
    dist_info_rows,
    fail_on,
    kernel_check_config,
    parse_rows,
    render_rows,
    version_rows,
    wheel_content_rows,
)
from build.resolve import BuildPlan, KernelPlan
from build.resolve.this_host import resolve_for_host
from build.spec import SpecErrors, load_image_spec, load_manifest
from contracts import atomic, folder_guard
from contracts.events import EventLog
from contracts.lock import LockedPackage
from contracts.schema import Problems

if TYPE_CHECKING:   # made by the CLI, only called here
    from build.remote_cache import RemoteCache


@dataclass
class HostKernel:
    name: str
    wheel: Path
    seconds: float = 0.0
    jobs: int = 0
    sources: int = 0
    rows: list[CheckRow] = field(default_factory=list)
    observed: dict[str, Any] = field(default_factory=dict)   # what the recipe saw (versions)
    sass: tuple[str, ...] = ()
    ptx: tuple[str, ...] = ()
    log: Path | None = None        # the compiler's output
    entry: KernelEntry | None = None    # its local cache entry, once its checks passed


def plan_here(image_dir: Path, manifest_path: Path, archs: tuple[str, ...]) -> BuildPlan:
    problems = Problems()
    manifest = load_manifest(manifest_path, problems)
    spec = load_image_spec(image_dir, problems)
    if spec is None:
        problems.raise_if_any(SpecErrors)
    return resolve_for_host(spec, manifest, archs, problems)


def split_jobs(kernels: list[KernelPlan], cores: int) -> dict[str, int]:
    """Share the cores (and memory) between kernels compiled at once, by how many sources each
    has: a kernel never gets more jobs than it has sources to compile."""
    sources = {k.name: (k.estimate.sources if k.estimate else 4) for k in kernels}
    total = sum(sources.values()) or 1
    out = {}
    for k in kernels:
        share = max(1, round(cores * sources[k.name] / total))
        out[k.name] = max(1, min(share, sources[k.name], parallel_jobs(k.memory_per_job_gb, cores=cores)))
    return out


def compile_here(kernel: KernelPlan, plan: BuildPlan, *, cache: CacheLayout, work: Path, jobs: int,
                 log: EventLog) -> HostKernel:
    sdist = fetch_pinned(kernel.sources[0], cache, log)
    inputs, out = work / "in", work / "out"
    shutil.rmtree(work, ignore_errors=True)
    stage_inputs(inputs, kernel, sdist)
    check_config = json.dumps(kernel_check_config(kernel, plan=plan, check_lock=False))
    command = [sys.executable, str(RECIPE), "--sdist", str(inputs / "src" / sdist.name), "--patches",
               str(inputs / "patches"), "--out", str(out), "--work", str(work / "scratch"), "--jobs", str(jobs),
               "--check-script", str(inputs / "check.py"), "--check-config", check_config]
    for key, value in sorted(kernel.build_env.items()):
        command += ["--env", f"{key}={value}"]
    expected = kernel.estimate.wall_seconds(jobs) if kernel.estimate else None
    progress = CompileProgress(log, kernel.name, expected_seconds=expected)
    log.emit("compile", f"{kernel.name} {kernel.version} for {','.join(kernel.archs)} here, {jobs} job(s)",
             step=kernel.name, eta=expected)
    started = time.monotonic()
    child = proc.popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                       env={**os.environ, "PYTHONPATH": ""})
    lines: list[str] = []
    assert child.stdout is not None
    with (work / "build.log").open("w") as build_log:
        for line in child.stdout:
            build_log.write(line)
            lines.append(line.rstrip("\n"))
            progress.feed(lines[-1])
    code = child.wait()
    seconds = time.monotonic() - started
    output = "\n".join(lines)
    if code != 0:
        tail = "\n".join(lines[-30:])
        raise BuildFailure(f"compiling {kernel.name} failed (exit {code}); last lines:\n{tail}",
                           f"read the compiler error above; the full log is {work / 'build.log'}")
    progress.finish(f"compiled in {seconds:.0f}s")
    wheels = sorted((out / "dist").glob("*.whl"))
    if len(wheels) != 1:
        raise BuildFailure(f"the {kernel.name} build produced {len(wheels)} wheels, expected 1", "see the build log")
    rows = parse_rows(output) or [CheckRow(kernel.name, "import checks", "FAIL", "the check script printed no result",
                                           "see the build log")]
    observed = json.loads((out / "observed.json").read_text())
    report = archs_of_wheel(wheels[0])
    rows += version_rows(kernel.name, observed, plan.toolchain)
    # no platform: a host plan's key names the image's platform, which need not be this host's
    rows += wheel_content_rows(kernel, wheels[0].name, report, python=plan.toolchain.python, platform=None)
    rows += dist_info_rows(kernel.name, wheels[0])
    return HostKernel(name=kernel.name, wheel=wheels[0], seconds=round(seconds, 1), jobs=jobs,
                      sources=kernel.estimate.sources if kernel.estimate else 0, rows=rows, observed=observed,
                      sass=tuple(report.sass), ptx=tuple(report.ptx), log=work / "build.log")


def cache_compiled(kernel: KernelPlan, built: HostKernel, store: KernelStore) -> KernelEntry:
    """A wheel compiled here, its checks passed, published into the local kernel cache with the
    meta.json an image build writes (compile.py), so it proves itself wherever it is fetched."""
    staging = store.staging(kernel.key)
    try:
        shutil.copyfile(built.wheel, staging / built.wheel.name)
        output = built.log.read_bytes() if built.log is not None and built.log.is_file() else b""
        (staging / "build.log").write_bytes(output)
        meta = entry_meta(kernel, staging / built.wheel.name, built.observed, built.sass, built.ptx, output,
                          built.seconds, built.jobs)
        return store.publish(kernel.key, staging, meta)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cached_or_fetched(plan: BuildPlan, kernels: list[KernelPlan], store: KernelStore, remote: RemoteCache | None,
                      log: EventLog) -> tuple[dict[str, KernelEntry], dict[str, str]]:
    """The kernels found in the local cache, else in the remote cache (checked against the key's
    own inputs, as in an image build), by name; and each one's state ("hit local", "hit
    registry"). The rest are compiled (a stale entry of a Triton kernel built from its sdist is
    evicted first)."""
    found: dict[str, KernelEntry] = {}
    states: dict[str, str] = {}
    for kernel in kernels:
        with store.lock(kernel.key):
            local = store.state(kernel.key, unkeyed_inputs(kernel))
            entry, state = local.entry, "hit local"
            if local.state == "stale":
                log.emit("kernels", f"cached entry {kernel.key[:16]} is stale ({local.detail}); rebuilding it",
                         step=kernel.name)
                store.evict(kernel.key)
            if entry is None and remote is not None and kernel.compiled:
                entry, state = remote.fetch_kernel(store, Expected.of(kernel, plan.toolchain)), "hit registry"
        if entry is not None:
            found[kernel.name], states[kernel.name] = entry, state
            log.emit("kernels", f"{'remote ' if state == 'hit registry' else ''}cache hit: {kernel.name} "
                     f"{kernel.version} (nothing to compile)", step=kernel.name, key=kernel.key[:16])
    return found, states


def build_here(image_dir: Path, *, manifest_path: Path, cache: CacheLayout, out: Path, archs: tuple[str, ...],
               log: EventLog, cores: int | None = None, install: Path | None = None, lock_path: Path | None = None,
               force: bool = False, remote: RemoteCache | None = None) -> dict:
    """`remote`: the remote cache (`--cache-registry`), asked for what the local cache lacks,
    and handed what was compiled or found locally (pushed when it is written)."""
    plan = plan_here(image_dir, manifest_path, archs)
    folder_guard.claim(out, folder_guard.OUTPUT_MARKER, what="output folder", option="--out", force=force)
    (out / "wheels").mkdir(exist_ok=True)
    store = KernelStore(cache)
    from_sdist = [k for k in plan.kernels if built_from_sdist(k)]   # compiled, or Triton pinned by its sdist
    found, states = cached_or_fetched(plan, from_sdist, store, remote, log)
    compiled = [k for k in from_sdist if k.name not in found]
    jobs = split_jobs(compiled, cores or os.cpu_count() or 1)
    results: dict[str, HostKernel] = {}
    errors: dict[str, BaseException] = {}

    def worker(kernel: KernelPlan) -> None:
        try:
            with store.lock(kernel.key):
                built = compile_here(kernel, plan, cache=cache, work=out / "work" / kernel.name,
                                     jobs=jobs[kernel.name], log=log)
                if all(row.status != "FAIL" for row in built.rows):    # only a sound wheel is cached
                    built.entry = cache_compiled(kernel, built, store)
            results[kernel.name] = built
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors[kernel.name] = exc

    threads = [threading.Thread(target=worker, args=(k,), name=f"compile-{k.name}") for k in compiled]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        name, exc = next(iter(errors.items()))
        if isinstance(exc, BuildFailure):
            raise exc
        raise BuildFailure(f"compiling {name} crashed: {type(exc).__name__}: {exc}", "see the log above")
    rows = [r for k in compiled for r in results[k.name].rows]
    if rows:
        log.emit("check", f"checks:\n{render_rows(rows)}")
    fail_on(rows, "a kernel built here is unsound")
    for kernel in compiled:
        found[kernel.name] = results[kernel.name].entry
        states[kernel.name] = f"miss (compiled in {results[kernel.name].seconds:.0f}s)"
    if remote is not None:    # a registry takes compiled kernels only
        kinds = {k.name: k.compiled for k in plan.kernels}
        for name, entry in found.items():
            if states[name] != "hit registry" and kinds[name]:
                remote.queue_kernel(entry)
        remote.flush()
    kernel_wheels = []
    for kernel in plan.kernels:
        if built_from_sdist(kernel):
            entry = found[kernel.name]
            dest = out / "wheels" / entry.wheel.name
            shutil.copyfile(entry.wheel, dest)
            kernel_wheels.append(KernelWheel(name=kernel.name, key=kernel.key, filename=dest.name,
                                             sha256=sha256_file(dest), path=dest,
                                             archs=tuple(entry.meta["archs"]["sass"])))
        else:
            for source in kernel.sources:
                path = fetch_pinned(source, cache, log)
                dest = out / "wheels" / source.filename
                shutil.copyfile(path, dest)
                kernel_wheels.append(KernelWheel(name=kernel.name, key=kernel.key, filename=dest.name,
                                                 sha256=source.sha256, path=dest))
    if install:
        proc.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                  "--disable-pip-version-check", "--target", str(install), *(str(w.path) for w in kernel_wheels)],
                 check=True)
    summary = {"image": plan.spec.name, "archs": list(plan.spec.target_archs),
               "toolchain": {"python": plan.toolchain.python, "torch": plan.toolchain.torch_version,
                             "cuda": plan.toolchain.cuda, "compiler": plan.toolchain.compiler},
               "kernels": {name: {"seconds": r.seconds, "jobs": r.jobs, "sources": r.sources, "wheel": r.wheel.name,
                                  "wheel_bytes": r.wheel.stat().st_size,
                                  "checks": [f"{x.check}: {x.status}" for x in r.rows]}
                           for name, r in results.items()},
               "cache": dict(sorted(states.items())),
               "specialisation": {k.name: k.to_dict()["specialisation"] for k in plan.kernels}}
    if remote is not None:
        summary["remote_cache"] = remote.record()
    atomic.write_json(out / "compile.json", summary, sort_keys=True)
    if lock_path:
        lock = host_lock(plan, tuple(kernel_wheels), build=remote.lock_record() if remote is not None else None)
        atomic.write_text(lock_path, lock.to_json())
    return summary


def host_lock(plan: BuildPlan, kernel_wheels: tuple[KernelWheel, ...], build: dict[str, str] | None = None):
    """The lock for this machine: the kernels built here, and the torch and transformers it has.
    `build`: what the lock records of how they were made (BuildLock.build)."""
    packages = []
    for name in ("torch", "transformers"):
        try:
            packages.append(LockedPackage(name=name, version=md.version(name), filename="(installed)", sha256=""))
        except md.PackageNotFoundError:
            pass
    transformers = next((p.version for p in packages if p.name == "transformers"), "")
    return make_lock(plan, (), kernel_wheels, {}, packages=tuple(packages), transformers=transformers, build=build)
