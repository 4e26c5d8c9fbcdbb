"""Kernel stage: every kernel in the plan becomes a checked wheel, from the cache when possible.

Compiled kernels: a cache hit (zero compilation, whatever else changed) or a compile from the
pinned sdist with recipe.py (in a builder container, compile.py; or on this host, build_here.py),
the GPU-free checks, then the cache. A registry hit is checked against the key's own inputs
before it enters the cache (acceptance.py). Triton kernels (pure Python) are pinned wheels,
fetched and hash-checked; one pinned by its sdist is built into a pure-Python wheel by the
same recipe and cached here (never shared through a registry, which takes compiled kernels
only). After the image is built, the in-container checks run again inside it for every kernel
wheel; a fetched one that fails them is evicted and compiled instead.
"""
from __future__ import annotations

import json
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from build.cache import CacheLayout
from build.engine import Engine
from build.errors import BuildFailure
from build.kernels.acceptance import Expected
from build.kernels.compile import built_from_sdist, compile_kernel, parallel_jobs, unkeyed_inputs
from build.kernels.pinned_sources import fetch_pinned
from build.kernels.store import KernelEntry, KernelStore
from build.kernels.wheel import KernelWheel
from build.kernels.wheel_checks import (
    CHECK_SCRIPT,
    CheckRow,
    fail_on,
    kernel_check_config,
    kernel_config,
    parse_rows,
    render_rows,
)
from build.resolve import BuildPlan
from contracts.events import EventLog, format_seconds

__all__ = ["EvictedKernels", "Expected", "KernelWheel", "ProvidedKernels", "provide_kernels", "expected_costs",
           "check_image", "check_wheel_in_image"]


# asked for a compiled kernel the local cache lacks (the remote cache, build/remote_cache/): it
# checks the entry against the key's own inputs, publishes it into the store (whose lock for
# that key the caller holds) and returns it
RemoteFetch = Callable[[KernelStore, Expected], "KernelEntry | None"]


@dataclass
class ProvidedKernels:
    wheels: tuple[KernelWheel, ...] = ()
    states: dict[str, str] = field(default_factory=dict)   # kernel -> "hit local" / "miss (compiled in Ns)" / ...
    entries: dict[str, KernelEntry] = field(default_factory=dict)   # compiled kernels' cache entries, by key


def provide_kernels(plan: BuildPlan, *, cache: CacheLayout, engine: Engine, log: EventLog,
                    builder_base: str | Callable[[], str], remote: RemoteFetch | None = None,
                    defer_pinned: bool = False) -> ProvidedKernels:
    """`builder_base`: its ref, or what makes it (called only when a kernel must be compiled).
    `defer_pinned`: a kernel pinned by its wheels is named, not downloaded (its wheels' time came
    from the registry's resolution entry); `fetch_pinned_wheels` downloads them if a stage needs them."""
    provided = ProvidedKernels()
    store = KernelStore(cache)
    out: list[KernelWheel] = []
    for kernel in plan.kernels:
        if not built_from_sdist(kernel):
            for source in kernel.sources:
                path = cache.source_path(source.sha256, source.filename) if defer_pinned else \
                    fetch_pinned(source, cache, log)
                out.append(KernelWheel(name=kernel.name, key=kernel.key, filename=source.filename,
                                       sha256=source.sha256, path=path))
            provided.states[kernel.name] = "pinned wheels (named by the registry's resolution; not downloaded)" \
                if defer_pinned else "pinned wheels (nothing to compile)"
            continue
        with store.lock(kernel.key):
            state = store.state(kernel.key, unkeyed_inputs(kernel))
            fetched = None
            if state.entry:
                log.emit("kernels", f"cache hit: {kernel.name} {kernel.version}", step=kernel.name,
                         key=kernel.key[:16])
                provided.states[kernel.name] = "hit local"
                entry = state.entry
            elif remote is not None and kernel.compiled and \
                    (fetched := remote(store, Expected.of(kernel, plan.toolchain))) is not None:
                log.emit("kernels", f"remote cache hit: {kernel.name} {kernel.version}", step=kernel.name,
                         key=kernel.key[:16])
                provided.states[kernel.name] = "hit registry"
                entry = fetched
            else:
                if state.state in ("corrupt", "stale"):
                    log.emit("kernels", f"cached entry {kernel.key[:16]} is {state.state} ({state.detail}); "
                             "rebuilding it", step=kernel.name)
                if state.state == "stale":   # sound, but not this plan's: publish never replaces a sound entry
                    store.evict(kernel.key)
                base = builder_base if isinstance(builder_base, str) else builder_base()
                entry = compile_kernel(kernel, plan, cache=cache, engine=engine, log=log,
                                       builder_base=base, store=store)
                made = "compiled" if kernel.compiled else "built (pure Python)"
                provided.states[kernel.name] = f"miss ({made} in {entry.meta['duration_s']:.0f}s)"
            if kernel.compiled:   # what a registry may share (it takes compiled kernels only)
                provided.entries[kernel.key] = entry
        out.append(KernelWheel(name=kernel.name, key=kernel.key, filename=entry.meta["wheel"],
                               sha256=entry.sha256, path=entry.wheel, archs=tuple(entry.meta["archs"]["sass"])))
    provided.wheels = tuple(out)
    return provided


def expected_costs(plan: BuildPlan, cache: CacheLayout,
                   remote_state: Callable[[Expected], str] | None = None) -> dict[str, tuple[str, str]]:
    """For `--plan`: per kernel key, (cache state, expected compile cost on this host).
    `remote_state`: the remote cache's answer for a key the local cache lacks ("in registry, not
    yet checked (...)" once what needs no download passed, else "miss" or why not)."""
    store = KernelStore(cache)
    states = {}
    for kernel in plan.kernels:
        if not built_from_sdist(kernel):
            states[kernel.key] = ("n/a", "none (Triton JIT at run time)")
            continue
        state = store.state(kernel.key, unkeyed_inputs(kernel))
        if state.entry:
            states[kernel.key] = ("hit local", "0s (cached)")
            continue
        remote = remote_state(Expected.of(kernel, plan.toolchain)) \
            if remote_state is not None and kernel.compiled else "miss"
        label = remote if state.state == "miss" else f"{state.state.upper()}: {state.detail}; will rebuild"
        if not kernel.compiled:
            recorded = store.recorded_duration(kernel.name)
            cost = (f"~{format_seconds(recorded)}" if recorded else "seconds") + \
                " (a pure-Python wheel from the sdist, nothing compiled; Triton JIT at run time)"
        elif kernel.estimate:
            jobs = parallel_jobs(kernel.memory_per_job_gb)
            wall = kernel.estimate.wall_seconds(jobs)
            cost = f"~{format_seconds(wall)} ({kernel.estimate.sources} sources, {jobs} job(s) here)"
        else:
            recorded = store.recorded_duration(kernel.name)
            cost = f"~{format_seconds(recorded)} (recorded build, other inputs)" if recorded else \
                "unknown (never built here)"
        if remote.startswith("in registry"):
            cost = f"0s (download) once its wheel passes its checks, else {cost}"
        states[kernel.key] = (label, cost)
    return states


class EvictedKernels(BuildFailure):
    """Kernel wheels fetched from a registry failed the in-image checks and were evicted from the
    local cache: a build started again compiles them."""

    def __init__(self, names: list[str], rows: list[CheckRow], image: str):
        super().__init__(f"image {image}: the wheels of {', '.join(names)}, fetched from a registry, failed the "
                         f"in-image checks and were evicted from the local cache\n{render_rows(rows)}",
                         "build again: they are compiled this time")
        self.names = names


def pinned_wheels(plan: BuildPlan) -> tuple:
    """The wheels of the plan's kernels pinned by their wheels (nothing to build), as pinned."""
    return tuple(source for kernel in plan.kernels if not built_from_sdist(kernel) for source in kernel.sources)


def fetch_pinned_wheels(plan: BuildPlan, cache: CacheLayout, log: EventLog) -> None:
    """Download what `defer_pinned` left out, each checked against its pinned sha256."""
    for source in pinned_wheels(plan):
        fetch_pinned(source, cache, log)


def check_image(plan: BuildPlan, *, engine: Engine, image: str, log: EventLog, provided: ProvidedKernels | None = None,
                cache: CacheLayout | None = None, refuse: Callable[[str, str], None] | None = None) -> list[CheckRow]:
    """Re-run the GPU-free checks inside the built image, as its runtime user, without network:
    import/ABI and entry points for every kernel wheel in the image, fetched or compiled.

    With `provided` and `cache`: a kernel whose wheel came from a registry (its meta.json's
    `fetched_from`: this build's fetch or an earlier one's) and fails here while the image's own
    rows (lock, torch) pass is evicted from the local cache and named: `refuse(key, why)` (the
    remote cache's WARN), else a WARN here. Then EvictedKernels, unless a kernel compiled here
    failed too (that build fails as any other)."""
    config = kernel_check_config(None, plan=plan, check_lock=True)
    rows = _run_checks(engine, image, config, log=log, what=f"image {image}", isolated=True, fail=False)
    failed = [r for r in rows if r.status == "FAIL"]
    if failed and provided is not None and cache is not None and \
            not any(r.subject in ("image", "torch") for r in failed):   # else the image is at fault, not a wheel
        evicted = _evict_fetched(plan, failed, provided, KernelStore(cache), log, refuse)
        if evicted and all(r.subject in evicted for r in failed):
            raise EvictedKernels(evicted, rows, image)
    fail_on(rows, f"image {image}: not sound")
    return rows


def _evict_fetched(plan: BuildPlan, failed: list[CheckRow], provided: ProvidedKernels, store: KernelStore,
                   log: EventLog, refuse: Callable[[str, str], None] | None) -> list[str]:
    evicted = []
    for kernel in plan.kernels:
        entry = provided.entries.get(kernel.key)
        rows = [r for r in failed if r.subject == kernel.name]
        if entry is None or not rows or not entry.meta.get("fetched_from"):
            continue
        why = "it failed the in-image checks (" + "; ".join(f"{r.check}: {r.detail}" for r in rows)[:300] + ")"
        with store.lock(kernel.key):
            store.evict(kernel.key)
        if refuse is not None:
            refuse(kernel.key, why)
        else:
            log.emit("kernels", f"WARN: kernel cache entry {kernel.key} ({kernel.name}, fetched from "
                     f"{str(entry.meta['fetched_from'])[:120]}) evicted: {why}; compiling it here instead",
                     step=kernel.name)
        evicted.append(kernel.name)
    return evicted


def check_wheel_in_image(wheel: Path, kernel, *, engine: Engine, image: str, log: EventLog) -> list[CheckRow]:
    """Import a kernel wheel beside another image's torch (the ABI check on demand): the wheel is
    unpacked onto PYTHONPATH inside the image, and the same in-container checks run."""
    info = engine.image(image)
    if info is None:
        raise BuildFailure(f"image {image} not found", "build it first, or pass an image tag that exists")
    labels = info["Config"].get("Labels") or {}
    config = {"plan_key": labels.get("io.ftimage.plan-key", ""), "check_lock": False, "skip_torch": True,
              "kernels": [kernel_config(kernel)]}
    with tempfile.TemporaryDirectory(prefix="ftimage-wheelcheck-") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():  # a wheel is user input too: nothing may land outside tmp
                if member.startswith("/") or ".." in Path(member).parts:
                    raise BuildFailure(f"{wheel.name} holds an unsafe path {member!r}", "use a wheel built by pip")
            zf.extractall(tmp)
        for path in [Path(tmp), *Path(tmp).rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the image's non-root user
        return _run_checks(engine, image, config, log=log, what=f"{wheel.name} beside {image}'s torch",
                           volumes={tmp: {"bind": "/opt/wheelcheck", "mode": "ro"}},
                           environment={"PYTHONPATH": "/opt/wheelcheck"})


def _run_checks(engine: Engine, image: str, config: dict, *, log: EventLog, what: str, isolated: bool = False,
                fail: bool = True, **run_options) -> list[CheckRow]:
    # -I (isolated): neither the working directory nor PYTHON* variables can change what runs
    flags = ["-I"] if isolated else []
    result = engine.run(image, [*flags, "-c", CHECK_SCRIPT.read_text(), json.dumps(config)], entrypoint=["python"],
                        network="none", timeout=900, **run_options)
    rows = parse_rows(result.output)
    if rows is None:
        raise BuildFailure(f"the checks did not run for {what} (exit {result.exit_code}):\n{result.output[-1500:]}",
                           "the image's python or torch is broken; see the output above")
    log.emit("check", f"checks for {what}:\n{render_rows(rows)}")
    if fail:
        fail_on(rows, f"{what}: not sound")
    return rows
