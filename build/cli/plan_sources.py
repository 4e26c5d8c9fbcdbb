"""`--plan`'s sources table: per stage, where its inputs will come from on this runner (the
engine, the local cache, the registry, or outside: the Debian mirror, the package index, a
compile) and the bytes that moves, so a fresh runner sees before it starts what it will pull
and from where.

Nothing is downloaded: a registry entry's manifest, signature and small metadata blob are read
and checked as the build checks them, and its size is what its manifest's descriptors say.
A registry base's layer, and the wheels of a registry resolution, are fetched by a build only
if a stage needs them (a layer or kernel made here), so they are shown as such, not counted.
"""
from __future__ import annotations

from build.base import debs_lock
from build.base.bootstrap import SPEC_LABEL, base_tag
from build.cache import CacheLayout
from build.resolve import BuildPlan, digest
from build.wheelhouse import cached_resolution
from contracts.table import render_table


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2 ** 20:,.1f} MiB"


def _row(stage: str, source: str, size: int | None, detail: str = "") -> dict:
    return {"stage": stage, "from": source, "bytes": size, "detail": detail}


def base_row(stage: str, ref, cache: CacheLayout, engine, remote) -> dict:
    if ref.bootstrap is None:
        wanted = f"{ref.image}@{ref.digest}" if ref.digest else ref.image
        held = engine is not None and engine.image(wanted) is not None
        return _row(f"base {stage}", "engine" if held else "missing", 0 if held else None,
                    "" if held else f"builds never pull: `docker pull {wanted}` first")
    spec_sha = digest(ref.bootstrap.spec_dict())
    held = engine.image(base_tag(ref.bootstrap)) if engine is not None else None
    if held is not None and ((held.get("Config") or {}).get("Labels") or {}).get(SPEC_LABEL) == spec_sha:
        return _row(f"base {stage}", "engine", 0)
    if remote is not None:
        from build.base.provide import expected_base

        state, layer_bytes = remote.base_state(expected_base(ref))
        if state == "in registry":
            meta = remote.entry_bytes.get(f"base-{spec_sha}", layer_bytes) - layer_bytes
            return _row(f"base {stage}", "registry", meta,
                        f"base.json only; its {_mib(layer_bytes)} layer only if a stage loads the base")
    lock = debs_lock.load_lock(ref.bootstrap.path)
    if lock is None:
        return _row(f"base {stage}", "debootstrap (Debian mirror)", None, "no deb lock: sizes unknown")
    missing = [deb for deb in lock.debs if not debs_lock.deb_path(cache, deb).is_file()]
    return _row(f"base {stage}", "debootstrap (Debian mirror)", sum(deb.size for deb in missing),
                f"{len(missing)} of {len(lock.debs)} locked .debs to download")


def wheelhouse_row(plan: BuildPlan, cache: CacheLayout, remote) -> dict:
    if cached_resolution(plan, cache) is not None:
        return _row("wheelhouse", "local cache", 0)
    from build.remote_cache.resolution_entries import resolution_entry_key

    key = resolution_entry_key(plan)
    if remote is not None and remote.resolution_state(key, plan) == "in registry":
        found = remote.fetch_resolution(key, plan)
        wheel_bytes = sum(w.size or 0 for w in found[0]) if found else None
        return _row("wheelhouse", "registry", remote.entry_bytes.get(f"resolution-{key}"),
                    f"resolution.json only; its {_mib(wheel_bytes)} of wheels only if the venv layer is made here")
    return _row("wheelhouse", "package index (pip)", None, "the closure is resolved and downloaded: size unknown "
                                                           "until resolved")


def kernel_rows(plan: BuildPlan, costs: dict[str, tuple[str, str]], remote) -> list[dict]:
    rows = []
    for kernel in plan.kernels:
        state, cost = costs.get(kernel.key, ("-", "-"))
        if state.startswith("hit local"):
            rows.append(_row(f"kernel {kernel.name}", "local cache", 0))
        elif state.startswith("in registry"):
            size = remote.entry_bytes.get(f"kernel-{kernel.key}") if remote is not None else None
            rows.append(_row(f"kernel {kernel.name}", "registry", size, "the wheel, checked when fetched"))
        elif state == "n/a":
            rows.append(_row(f"kernel {kernel.name}", "package index (pinned wheels)", None, cost))
        else:
            rows.append(_row(f"kernel {kernel.name}", "compile (pinned sdist from the index)", None, cost))
    return rows


def layer_source_rows(layers: list[dict], remote) -> list[dict]:
    rows = []
    for layer in layers:
        state, key = layer["state"], layer["key"]
        if state == "hit local":
            rows.append(_row(f"layer {layer['layer']}", "local cache", 0))
        elif state == "hit registry":
            size = remote.entry_bytes.get(f"layer-{key}") if remote is not None else None
            rows.append(_row(f"layer {layer['layer']}", "registry", size))
        elif state == "unknown":
            rows.append(_row(f"layer {layer['layer']}", "registry or assembled here" if remote is not None
                             else "assembled here", None, "its key is known only once the stages before it ran"))
        else:
            rows.append(_row(f"layer {layer['layer']}", "assembled here", None, layer["detail"]))
    return rows


def source_rows(plan: BuildPlan, cache: CacheLayout, *, engine, remote, costs: dict, layers: list[dict]) -> list[dict]:
    rows = [base_row(stage, ref, cache, engine, remote)
            for stage, ref in (("builder", plan.spec.builder_base), ("runtime", plan.spec.runtime_base))]
    rows.append(wheelhouse_row(plan, cache, remote))
    return rows + kernel_rows(plan, costs, remote) + layer_source_rows(layers, remote)


def render_sources(rows: list[dict]) -> str:
    known = [r["bytes"] for r in rows if r["bytes"] is not None]
    outside = [r for r in rows if r["from"].startswith(("debootstrap", "package index", "compile"))]
    total = (f"registry {_mib(sum(r['bytes'] or 0 for r in rows if r['from'] == 'registry'))}; "
             f"{len(outside)} stage(s) fetch from outside the registry" if known else "")
    table = render_table([[r["stage"], r["from"], _mib(r["bytes"]), r["detail"]] for r in rows],
                         ["STAGE", "COMES FROM", "BYTES", "DETAIL"], wrap={3: 70})
    return f"where each stage's inputs come from on this runner\n{table}\n{total}"
