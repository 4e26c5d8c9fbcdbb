"""Assemble the runtime image of a plan from its rendered context, and load it into the engine."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from build.cache import CacheLayout
from build.context.render import APP_DIR, GATE, VENV, RenderedContext
from build.oci import docker_archive
from build.oci.baselayer import TrainingUser, base_epoch, base_layers
from build.oci.image import AssembledImage, RuntimeSettings, assemble, file_layer, tree_layer, write_layout
from build.oci.layercache import CachedLayer, LayerCache, RefusedLayers, RemoteFetch
from build.oci.tarlayer import EXEC_MODE, FILE_MODE
from build.oci.venv import LockedWheel, capped, venv_layer
from build.resolve import BuildPlan
from contracts.events import EventLog
from contracts.lock import LOCK_PATH

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
APP_CREATED_BY = f"ftimage app: {APP_DIR} and {GATE}"


def app_extra(gate: bytes) -> dict[str, tuple[bytes, int]]:
    """What the app layer holds beside the app folder: the gate script (also for `--plan`)."""
    return {GATE.lstrip("/"): (gate, EXEC_MODE)}


@dataclass(frozen=True)
class Assembly:
    image: AssembledImage
    layout: Path
    layers_sent: int          # how many layers the engine had to be sent (0 when it had the image)
    states: dict[str, str]    # per layer: "hit local", "hit registry" or "miss"
    layers: tuple[CachedLayer, ...] = ()


def lock_epoch(wheels_time: int, runtime_base: dict) -> int:
    """The time of the lock layer and the SBOM: that of their inputs (the wheels and the base),
    never the commit's, so a new commit leaves the layer as it was."""
    return capped(max(wheels_time, base_epoch({"created": runtime_base.get("Created", "")})))


def runtime_settings(plan: BuildPlan, base_env: list[str], labels: dict[str, str]) -> RuntimeSettings:
    user = plan.spec.user
    kept = [e for e in base_env if not e.startswith(("PATH=", "HOME="))]
    env = [f"PATH={VENV}/bin:/opt/ftimage/bin:{BASE_PATH}", *kept,
           "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", f"FTIMAGE_LOCK={LOCK_PATH}",
           f"TRITON_CACHE_DIR=/home/{user.name}/.triton/cache", f"HOME=/home/{user.name}"]
    return RuntimeSettings(user=f"{user.uid}:{plan.spec.gid}", env=env,
                           entrypoint=[f"{VENV}/bin/python", "-I", "-m", "entrypoint"], cmd=["info"],
                           workdir="/workspace", labels=labels)


def assemble_runtime_image(plan: BuildPlan, context: RenderedContext, *, wheels: list[LockedWheel],
                           runtime_base: str, engine, cache: CacheLayout, out_dir: Path, app_epoch: int,
                           wheels_time: int, labels: dict[str, str], log: EventLog,
                           remote: RemoteFetch | None = None, runtime_base_info: dict | None = None,
                           load_runtime_base: Callable[[], str] | None = None,
                           fetch_wheels: Callable[[], None] | None = None) -> Assembly:
    """`wheels_time`: the newest entry time in the wheels (venv.wheels_epoch), read once by the caller.
    `remote`: asked for a layer the local layer cache lacks (the remote cache).
    `runtime_base_info`: the base's inspect fields when the engine does not hold it yet (a
    registry base), with `load_runtime_base` to put it there and `fetch_wheels` to put the wheel
    files in the cache, each called only if a layer must be made here."""
    layers_cache = LayerCache(cache.layers, remote=remote)
    layers_cache.sweep()
    base_info = runtime_base_info or engine.image(runtime_base) or {}
    load = load_runtime_base or (lambda: runtime_base)
    user = TrainingUser(plan.spec.user.name, plan.spec.user.uid, plan.spec.gid)
    with layers_cache.assembling():
        with cache.scratch_dir("assemble") as scratch:
            base = base_layers(engine, layers_cache, Path(scratch), runtime_base, user, info=base_info, load=load)
            venv = venv_layer(engine=engine, cache=layers_cache, scratch=Path(scratch), wheels=wheels, venv=VENV,
                              app_dir=APP_DIR, python_minor=plan.toolchain.python, base_ref=load,
                              base_diff_ids=[layer.diff_id for layer in base], log=log, wheels_time=wheels_time,
                              fetch_wheels=fetch_wheels)
        directory = context.directory
        lock = file_layer(layers_cache, "lock", {
            f"{str(LOCK_PATH.parent).lstrip('/')}/{name}": ((directory / name).read_bytes(), FILE_MODE)
            for name in ("build.lock.json", "sbom.cdx.json")}, lock_epoch(wheels_time, base_info),
            f"ftimage lock: {LOCK_PATH} and the SBOM")
        app = tree_layer(layers_cache, "app", directory / "app", APP_DIR, app_epoch, APP_CREATED_BY,
                         extra=app_extra((directory / "ftimage-gate").read_bytes()))
        layers = [*base, venv, lock, app]
        for key in layers_cache.damaged:
            log.emit("image", f"WARN: cached layer {key[:12]} no longer matched its digest (edited on disk?): "
                              "removed and rebuilt")
        layers_cache.record_use(plan.spec.name, [layer.key for layer in layers])
    pruned = layers_cache.prune_unused()
    if pruned:
        log.emit("image", f"removed {len(pruned)} superseded layer(s) from the layer cache")
    states = {f"{layer.name}:{layer.diff_id[7:19]}": layer_state(layer) for layer in layers}
    base_env = list(((base_info.get("Config") or {}).get("Env")) or [])
    image = assemble(layers, runtime_settings(plan, base_env, labels), app_epoch)
    layout = write_layout(image, out_dir, plan.tag)
    sent = load_and_settle(engine, image, plan.tag, layers, layers_cache)
    layers = [layers_cache.lookup(layer.key, check_content=False) or layer for layer in layers]
    log.emit("image", f"image {image.image_id[:19]} ({len(layers)} layers, {sent} sent to the engine), "
             f"manifest {image.manifest_digest[:19]}")
    return Assembly(image=image, layout=layout, layers_sent=sent, states=states, layers=tuple(layers))


def load_and_settle(engine, image: AssembledImage, tag: str, layers: list[CachedLayer],
                    layers_cache: LayerCache) -> int:
    """Load the image into the engine (or tag it, if the engine has it) while the diffIDs of the
    layers just fetched are checked, then publish those that passed. One that failed: the image
    is removed from the engine and RefusedLayers raised (whatever the load did), so no image
    made from an unchecked layer stays. Returns how many layers were sent."""
    try:
        if engine.image(image.image_id) is not None:
            engine.tag(image.image_id, tag)
            return 0
        return docker_archive.load(engine, image.config, tag, layers, image.image_id)[1]
    finally:
        refused = layers_cache.settle()
        if refused:
            engine.remove(tag)
            engine.remove(image.image_id)
            raise RefusedLayers(refused)


def layer_state(layer: CachedLayer) -> str:
    if not layer.reused:
        return "miss"
    return "hit registry" if layer.source == "registry" else "hit local"
