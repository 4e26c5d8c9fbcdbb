"""Kernel stage: every kernel in the plan becomes a checked wheel, from the cache when possible.

Compiled kernels: a cache hit (zero compilation, whatever else changed) or a compile from the
pinned sdist with recipe.py (in a builder container, compile.py; or on this host, build_here.py),
the GPU-free checks, then the cache. Triton kernels (pure Python) are pinned wheels, fetched
and hash-checked. After the image is built, the same checks run again inside it.
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
from build.kernels.compile import compile_kernel, parallel_jobs
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

__all__ = ["KernelWheel", "ProvidedKernels", "provide_kernels", "expected_costs", "check_image",
           "check_wheel_in_image"]


# asked for a compiled kernel the local cache lacks (the remote cache, build/remote_cache/): it
# publishes the entry into the store (whose lock for that key the caller holds) and returns it
RemoteFetch = Callable[[KernelStore, str], "KernelEntry | None"]


@dataclass
class ProvidedKernels:
    wheels: tuple[KernelWheel, ...] = ()
    states: dict[str, str] = field(default_factory=dict)   # kernel -> "hit local" / "miss (compiled in Ns)" / ...
    entries: dict[str, KernelEntry] = field(default_factory=dict)   # compiled kernels' cache entries, by key


def provide_kernels(plan: BuildPlan, *, cache: CacheLayout, engine: Engine, log: EventLog,
                    builder_base: str | Callable[[], str], remote: RemoteFetch | None = None) -> ProvidedKernels:
    """`builder_base`: its ref, or what makes it (called only when a kernel must be compiled)."""
    provided = ProvidedKernels()
    store = KernelStore(cache)
    out: list[KernelWheel] = []
    for kernel in plan.kernels:
        if kernel.kind == "triton":
            for source in kernel.sources:
                path = fetch_pinned(source, cache, log)
                out.append(KernelWheel(name=kernel.name, key=kernel.key, filename=source.filename,
                                       sha256=source.sha256, path=path))
            provided.states[kernel.name] = "pinned wheels (nothing to compile)"
            continue
        with store.lock(kernel.key):
            state = store.state(kernel.key)
            fetched = None
            if state.entry:
                log.emit("kernels", f"cache hit: {kernel.name} {kernel.version}", step=kernel.name,
                         key=kernel.key[:16])
                provided.states[kernel.name] = "hit local"
                entry = state.entry
            elif remote is not None and (fetched := remote(store, kernel.key)) is not None:
                log.emit("kernels", f"remote cache hit: {kernel.name} {kernel.version}", step=kernel.name,
                         key=kernel.key[:16])
                provided.states[kernel.name] = "hit registry"
                entry = fetched
            else:
                if state.state == "corrupt":
                    log.emit("kernels", f"cached entry {kernel.key[:16]} is corrupt ({state.detail}); "
                             "rebuilding it", step=kernel.name)
                base = builder_base if isinstance(builder_base, str) else builder_base()
                entry = compile_kernel(kernel, plan, cache=cache, engine=engine, log=log,
                                       builder_base=base, store=store)
                provided.states[kernel.name] = f"miss (compiled in {entry.meta['duration_s']:.0f}s)"
            provided.entries[kernel.key] = entry
        out.append(KernelWheel(name=kernel.name, key=kernel.key, filename=entry.meta["wheel"],
                               sha256=entry.sha256, path=entry.wheel, archs=tuple(entry.meta["archs"]["sass"])))
    provided.wheels = tuple(out)
    return provided


def expected_costs(plan: BuildPlan, cache: CacheLayout,
                   remote_state: Callable[[str], str] | None = None) -> dict[str, tuple[str, str]]:
    """For `--plan`: per kernel key, (cache state, expected compile cost on this host).
    `remote_state`: the remote cache's answer for a key the local cache lacks ("hit registry"
    or why not)."""
    store = KernelStore(cache)
    states = {}
    for kernel in plan.kernels:
        if kernel.kind == "triton":
            states[kernel.key] = ("n/a", "none (Triton JIT at run time)")
            continue
        state = store.state(kernel.key)
        if state.entry:
            states[kernel.key] = ("hit local", "0s (cached)")
            continue
        remote = remote_state(kernel.key) if remote_state is not None else "miss"
        if remote == "hit registry":
            states[kernel.key] = ("hit registry", "0s (download)")
            continue
        label = remote if state.state == "miss" else f"CORRUPT: {state.detail}; will rebuild"
        if kernel.estimate:
            jobs = parallel_jobs(kernel.memory_per_job_gb)
            wall = kernel.estimate.wall_seconds(jobs)
            states[kernel.key] = (label, f"~{format_seconds(wall)} ({kernel.estimate.sources} sources, "
                                         f"{jobs} job(s) here)")
        else:
            recorded = store.recorded_duration(kernel.name)
            states[kernel.key] = (label, f"~{format_seconds(recorded)} (recorded build, other inputs)"
                                  if recorded else "unknown (never built here)")
    return states


def check_image(plan: BuildPlan, *, engine: Engine, image: str, log: EventLog) -> list[CheckRow]:
    """Re-run the GPU-free checks inside the built image, as its runtime user, without network."""
    return _run_checks(engine, image, kernel_check_config(None, plan=plan, check_lock=True), log=log,
                       what=f"image {image}", isolated=True)


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
                **run_options) -> list[CheckRow]:
    # -I (isolated): neither the working directory nor PYTHON* variables can change what runs
    flags = ["-I"] if isolated else []
    result = engine.run(image, [*flags, "-c", CHECK_SCRIPT.read_text(), json.dumps(config)], entrypoint=["python"],
                        network="none", timeout=900, **run_options)
    rows = parse_rows(result.output)
    if rows is None:
        raise BuildFailure(f"the checks did not run for {what} (exit {result.exit_code}):\n{result.output[-1500:]}",
                           "the image's python or torch is broken; see the output above")
    log.emit("check", f"checks for {what}:\n{render_rows(rows)}")
    fail_on(rows, f"{what}: not sound")
    return rows
