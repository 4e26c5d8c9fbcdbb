"""`--plan`'s layer rows: each layer of the runtime image (the edited base's, venv, lock, app)
with its cache key and state ("hit local", "hit registry", "miss") where that key can be known
before building, and otherwise what the key waits on, never a guess.

Nothing is built, downloaded or written: the runtime base is read from the engine when one
answers, the wheels from the cache's recorded resolution, the kernels from the kernel cache,
the app from the checkout (copied into a temporary folder, as a build stages it). The keys are
computed by the functions the build itself uses (build/oci/), so a row's key is the build's.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from build.base.bootstrap import SPEC_LABEL, base_tag
from build.cache import CacheLayout
from build.errors import BuildFailure
from build.kernels.store import KernelStore
from build.oci.baselayer import TrainingUser, base_keys
from build.oci.image import tree_layer_key
from build.oci.layercache import LayerCache
from build.resolve import BuildPlan, digest
from build.source_date import source_date_epoch
from build.wheelhouse import cached_resolution
from contracts.table import render_table

LOCK_WAITS = ("unknown until the build writes the lock: its key is the bytes of build.lock.json and the SBOM, "
              "which record the bases' image IDs and packages and every wheel's and kernel's hash")


def engine_for_plan():
    """(the engine, "") when one answers, else (None, why not): `--plan` works without one."""
    try:
        from build.engine.docker_engine import DockerEngine  # the docker SDK: optional for --plan

        return DockerEngine.connect(timeout=10), ""
    except ImportError:
        return None, "the docker SDK is not installed here"
    except BuildFailure as exc:
        return None, str(exc)


def layer_rows(plan: BuildPlan, cache: CacheLayout, *, engine, engine_problem: str = "",
               remote_state: Callable[[str], str] | None = None,
               registry_base: list[str] | None = None) -> list[dict[str, str | None]]:
    """One row per layer: {"layer", "key" (None when unknown), "state", "detail"}.
    `registry_base`: the runtime base's diffIDs from its registry entry, used when the engine
    does not hold the base (a build would not load it either, when its layers are all found)."""
    layers = LayerCache(cache.layers)

    def row(layer: str, key: str | None, why: str = "") -> dict[str, str | None]:
        if key is None:
            return {"layer": layer, "key": None, "state": "unknown", "detail": why}
        if layers.lookup(key, check_content=False) is not None:
            detail = "hit local"
        else:
            detail = remote_state(key) if remote_state is not None else "miss"
        return {"layer": layer, "key": key, "state": detail.split(" (")[0].lower(), "detail": detail}

    rows = []
    diff_ids, why = _runtime_base(plan, engine, engine_problem)
    if diff_ids is None and registry_base:
        diff_ids, why = registry_base, ""
    base = []
    if diff_ids is None:
        rows.append(row("base", None, why))
    else:
        user = plan.spec.user
        keys = base_keys(diff_ids, TrainingUser(user.name, user.uid, plan.spec.gid))
        rows += [row(f"base {i + 1}/{len(keys)}", key) for i, key in enumerate(keys)]
        base = [layers.lookup(key, check_content=False) for key in keys]
    key, why = _venv(plan, cache, base, why)
    rows.append(row("venv", key, why))
    rows.append(row("lock", None, LOCK_WAITS))
    rows.append(row("app", _app_key()))
    return rows


def _runtime_base(plan: BuildPlan, engine, problem: str) -> tuple[list[str] | None, str]:
    """The runtime base's diffIDs as the engine holds it (the image a build would use), or why
    they are unknown."""
    ref = plan.spec.runtime_base
    if ref.bootstrap:
        wanted, waits = base_tag(ref.bootstrap), "unknown until the runtime base is bootstrapped"
    else:
        wanted = f"{ref.image}@{ref.digest}" if ref.digest else ref.image
        waits = f"unknown until the runtime base {wanted} is in the engine (`docker pull` it)"
    if engine is None:
        return None, f"{waits} (no engine to read it from: {problem})"
    info = engine.image(wanted) or (engine.image(ref.image) if not ref.bootstrap else None)
    if ref.bootstrap and info is not None and \
            ((info.get("Config") or {}).get("Labels") or {}).get(SPEC_LABEL) != digest(ref.bootstrap.spec_dict()):
        info = None      # another spec under that tag: a build bootstraps it again
    if ref.digest and info is not None and not any(d.endswith(ref.digest) for d in info.get("RepoDigests") or []):
        info = None
    layers = list(((info or {}).get("RootFS") or {}).get("Layers") or [])
    if not layers:
        return None, f"{waits} ({wanted} is not in the engine)"
    return layers, ""


def _venv(plan: BuildPlan, cache: CacheLayout, base: list, why_base: str) -> tuple[str | None, str]:
    """The venv layer's key, or what it waits on: the edited base layers' diffIDs (so those
    layers, in the local cache), the recorded wheelhouse resolution, and every kernel's wheel."""
    # the context renderer (cyclonedx, the SBOM library) and the venv assembler (installer) load
    # only here: `kernels build-here` imports this module on a GPU host that has neither
    from build.context.render import APP_DIR, VENV
    from build.oci.venv import LockedWheel, capped, venv_key, wheels_epoch

    if not base:
        return None, why_base + "; the venv's key holds the base layers' diffIDs"
    if not all(base):
        return None, "unknown until the base layers are assembled (or fetched) into the local cache: the venv's " \
                     "key holds their diffIDs"
    resolved = cached_resolution(plan, cache)
    if resolved is None:
        return None, "unknown until the wheelhouse is resolved (the build downloads the closure with pip)"
    wheels = [LockedWheel(w.filename, w.sha256, cache.wheel_path(w.sha256, w.filename)) for w in resolved]
    store = KernelStore(cache)
    for kernel in plan.kernels:
        if kernel.kind == "triton":
            paths = [cache.source_path(s.sha256, s.filename) for s in kernel.sources]
            if not all(p.is_file() for p in paths):
                return None, f"unknown until the pinned wheels of {kernel.name} are fetched"
            wheels += [LockedWheel(s.filename, s.sha256, p) for s, p in zip(kernel.sources, paths, strict=True)]
            continue
        entry = store.get(kernel.key)
        if entry is None:
            return None, f"unknown until {kernel.name} is compiled (or fetched from the registry): the venv's key " \
                         "holds its wheel's hash"
        wheels.append(LockedWheel(entry.meta["wheel"], entry.sha256, entry.wheel))
    return venv_key(wheels, venv=VENV, app_dir=APP_DIR, python_minor=plan.toolchain.python,
                    base_diff_ids=[layer.diff_id for layer in base], epoch=capped(wheels_epoch(wheels))), ""


def _app_key() -> str:
    """The app layer's key: the project's runtime packages as a build stages them, the gate, and
    SOURCE_DATE_EPOCH (HEAD's commit time when unset)."""
    # as in _venv: the renderer and the runtime image's assembler need cyclonedx and installer
    from build.context.render import APP_DIR, gate_script, stage_app
    from build.oci.runtime_image import app_extra

    with tempfile.TemporaryDirectory(prefix="ftimage-plan-") as scratch:
        app = Path(scratch) / "app"
        stage_app(app)
        key, _ = tree_layer_key("app", app, APP_DIR, source_date_epoch(), app_extra(gate_script().encode()))
    return key


def render_rows(rows: list[dict[str, str | None]]) -> str:
    return render_table([[r["layer"], (r["key"] or "-")[:16], r["detail"]] for r in rows],
                        ["LAYER", "KEY", "CACHE"], wrap={2: 90})
