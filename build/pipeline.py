"""`python -m build images/<name>` end to end: plan -> bases -> wheelhouse -> kernels -> context ->
image -> check -> prune (`build_image`), then push and share (`build_and_publish`)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from build import kernels as kernel_stage
from build.base import debs_lock
from build.base.provide import STAGES, Bases
from build.build_report import REPORT_NAME, BuildReport
from build.cache import CacheLayout
from build.context.render import render_context
from build.engine import Engine, connect
from build.engine.diskspace import make_room
from build.oci.layercache import RefusedLayers
from build.oci.runtime_image import assemble_runtime_image, lock_epoch
from build.oci.venv import LockedWheel, wheels_epoch
from build.publish.push import push_image
from build.publish.reference import PushTarget
from build.remote_cache import RemoteCache
from build.remote_cache.resolution_entries import resolution_entry_key
from build.resolve import BuildPlan
from build.source_date import source_date_epoch
from build.wheelhouse import Resolution, fill_wheelhouse, wheel_files
from contracts import atomic, folder_guard
from contracts.events import EventLog

CONTEXT_LABEL = "io.ftimage.context.sha256"
LOCK_LABEL = "io.ftimage.lock.sha256"
BASE_ID_LABEL = "io.ftimage.base.id"
IMAGE_LABEL = "io.ftimage.image"
STAGE_LABEL = "io.ftimage.stage"
BUILDER_LABEL = "io.ftimage.builder"   # oci or dockerfile: one context gives two different images


class PhaseTimer:
    """Wall time per phase, for the build report; each phase is also an event."""

    def __init__(self, log: EventLog):
        self.log = log
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        started = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
            self.log.emit(phase, f"{phase} done in {elapsed:.1f}s", elapsed=elapsed)


BUILDERS = ("oci", "dockerfile")


def build_image(plan: BuildPlan, *, cache: CacheLayout, out_dir: Path, log: EventLog,
                engine: Engine | None = None, force: bool = False, builder: str = "oci",
                remote: RemoteCache | None = None, write_report: bool = True) -> BuildReport:
    """Build the image `plan` describes and (unless `write_report` is False) write its build
    report. `remote`: the remote cache, read for what the local cache lacks; the kernel entries
    this build used are pushed right after the kernel stage, its layers are queued on it for
    `build_and_publish` to push after any image push.

    A kernel wheel fetched from a registry that fails the image's check stage is evicted there
    (and named); the build then runs once more, which compiles it: a build succeeds only with
    wheels that passed the in-image checks. Likewise a fetched layer whose diffID check (run
    while the engine loaded the image) fails: the image is removed, the entry named, and the
    build runs once more, assembling that layer here."""
    options = dict(cache=cache, out_dir=out_dir, log=log, engine=engine, force=force, builder=builder,
                   remote=remote, write_report=write_report)
    try:
        return _build_image(plan, **options)
    except kernel_stage.EvictedKernels as exc:
        log.emit("build", f"building again: {', '.join(exc.names)} failed the in-image checks as fetched, and "
                          "are compiled this time")
        return _build_image(plan, **options)
    except RefusedLayers as exc:
        if remote is None:
            raise
        for key, why in exc.refused.items():    # named, and not fetched again by this build
            remote.refuse_layer(key, why)
        log.emit("build", f"building again: {len(exc.refused)} fetched layer(s) failed their diffID check and were "
                          "removed; they are assembled here this time")
        return _build_image(plan, **options)


def _build_image(plan: BuildPlan, *, cache: CacheLayout, out_dir: Path, log: EventLog, engine: Engine | None,
                 force: bool, builder: str, remote: RemoteCache | None, write_report: bool) -> BuildReport:
    started = time.monotonic()
    folder_guard.claim(out_dir, folder_guard.OUTPUT_MARKER, what="output folder", option="--out", force=force)
    timer = PhaseTimer(log)
    report = BuildReport(image=plan.spec.name, tag=plan.tag, plan_key=plan.plan_key, builder=builder)
    with timer("engine"):
        engine = engine or connect()
    with timer("bases"):
        provider = Bases(plan, engine, cache, log, remote)
        bases = provider.find()
        if builder == "dockerfile":    # its FROM lines need both in the engine
            for stage in STAGES:
                provider.loaded(stage)
        debs = provider.packages("runtime")   # for the SBOM
    with timer("wheelhouse"):
        entry_key = resolution_entry_key(plan)
        resolution = fill_wheelhouse(plan, cache, log, remote=(lambda _key, p: remote.fetch_resolution(entry_key, p))
                                     if remote else None)
        if builder == "dockerfile":
            resolution = wheel_files(resolution, plan, cache, log)
        report.cache["wheelhouse"] = wheelhouse_state(resolution)
    with timer("kernels"):
        provided = kernel_stage.provide_kernels(plan, cache=cache, engine=engine, log=log,
                                                builder_base=lambda: provider.loaded("builder"),
                                                remote=remote.fetch_kernel if remote else None,
                                                defer_pinned=not resolution.files)
        for name, state in provided.states.items():
            report.cache[f"kernel:{name}"] = state
        if remote is not None:     # pushed now: what this build compiled is shared even if a later stage fails
            for entry in provided.entries.values():
                remote.queue_kernel(entry)
            remote.flush()
    with timer("render"):
        pinned = {source.sha256 for source in kernel_stage.pinned_wheels(plan)}
        # the pip closure and the kernels' pinned wheels (their time travels in the resolution
        # entry), then the wheels of the kernels built here or fetched from the registry
        named = [LockedWheel(w.filename, w.sha256, cache.wheel_path(w.sha256, w.filename))
                 for w in resolution.wheels] + \
            [LockedWheel(k.filename, k.sha256, k.path) for k in provided.wheels if k.sha256 in pinned]
        built = [LockedWheel(k.filename, k.sha256, k.path) for k in provided.wheels if k.sha256 not in pinned]
        locked_wheels = named[:len(resolution.wheels)] + [LockedWheel(k.filename, k.sha256, k.path)
                                                          for k in provided.wheels]
        app_epoch = source_date_epoch()
        wheels_time, sbom_epoch = 0, app_epoch
        if builder == "oci":
            named_time = wheels_epoch(named) if resolution.epoch is None else resolution.epoch
            wheels_time = max(named_time, wheels_epoch(built))   # = wheels_epoch(locked_wheels)
            sbom_epoch = lock_epoch(wheels_time, provider.info("runtime"))
            if remote is not None and resolution.source != "registry":
                remote.queue_resolution(entry_key, resolution.wheels, named_time)
        context = render_context(plan, out_dir / "context", wheels=resolution.wheels, cache=cache,
                                 kernel_wheels=provided.wheels,
                                 base_refs={s: b.ref for s, b in bases.items()},
                                 base_ids=base_identities(plan, provider), base_packages=debs,
                                 epoch=app_epoch, sbom_epoch=sbom_epoch,
                                 lock_build=remote.lock_record() if remote else None, wheel_files=resolution.files)
        report.lock_sha256 = context.lock.sha256()
        report.context_sha256 = context.digest
        for name in ("build.lock.json", "sbom.cdx.json"):
            atomic.write_bytes(out_dir / name, (context.directory / name).read_bytes())
    labels = {**context.labels, CONTEXT_LABEL: context.digest, LOCK_LABEL: report.lock_sha256,
              BASE_ID_LABEL: bases["runtime"].id, IMAGE_LABEL: plan.spec.name, BUILDER_LABEL: builder}
    if builder == "oci":
        with timer("image"):
            report.pruned += make_room(engine, image=plan.tag, wheel_bytes=wheelhouse_bytes(context.directory),
                                       free_layer_cache=lambda: prune_builder_stages(engine, plan, keep=0), log=log)
            assembly = assemble_runtime_image(plan, context, wheels=locked_wheels, runtime_base=bases["runtime"].ref,
                                              engine=engine, cache=cache, out_dir=out_dir, app_epoch=app_epoch,
                                              wheels_time=wheels_time, labels=labels, log=log,
                                              remote=remote.fetch_layer if remote else None,
                                              runtime_base_info=provider.info("runtime"),
                                              load_runtime_base=lambda: provider.loaded("runtime"),
                                              fetch_wheels=lambda: fetch_named_wheels(resolution, plan, cache, log,
                                                                                      report))
            for layer in assembly.layers if remote else ():
                remote.queue_layer(layer)
            image = assembly.image
            report.image_id = image.image_id
            report.size_bytes = int((engine.image(image.image_id) or {}).get("Size", 0))
            report.manifest_digest, report.diff_ids = image.manifest_digest, image.diff_ids
            report.layout, report.layers_sent = str(assembly.layout), assembly.layers_sent
            report.cache.update({f"layer {name}": state for name, state in assembly.states.items()})
            report.cache["image"] = "hit" if assembly.layers_sent == 0 and \
                all(state == "hit local" for state in assembly.states.values()) else "miss"
    else:
        _classic_build(plan, engine, context, labels, report, log, timer)
    with timer("check"):
        kernel_stage.check_image(plan, engine=engine, image=plan.tag, log=log, provided=provided, cache=cache,
                                 refuse=remote.refuse_kernel if remote else None)
    with timer("prune"):
        report.pruned += prune_superseded(engine, plan, report.image_id, log)
    for stage in STAGES:      # what each base came to: a registry one may have been loaded since
        report.cache[f"base:{stage}"] = provider.states[stage]
    provider.share()
    report.phase_seconds = {k: round(v, 2) for k, v in timer.seconds.items()}
    report.total_seconds = round(time.monotonic() - started, 2)
    if remote is not None:
        report.remote_cache = remote.record()
    if write_report:
        atomic.write_text(out_dir / REPORT_NAME, report.to_json())
    return report


def build_and_publish(plan: BuildPlan, *, cache: CacheLayout, out_dir: Path, log: EventLog,
                      force: bool = False, builder: str = "oci", remote: RemoteCache | None = None,
                      push_target: PushTarget | None = None, sign_key=None) -> BuildReport:
    """What `python -m build IMAGE_DIR [--push REPO [--sign KEY]] [--cache-registry REPO]` does:
    build the image, push it (and sign it), then flush the remote cache's queued layers, then write
    the report, once, with what all of them did. The order matters: the flush mounts layer blobs
    the push already stored in the same registry, instead of sending them twice. A push or flush
    that fails still leaves the report of the image that was built (without what failed)."""
    report = build_image(plan, cache=cache, out_dir=out_dir, log=log, force=force, builder=builder,
                         remote=remote, write_report=False)
    try:
        if push_target is not None:
            push_image(report, push_target, out_dir=None, log=log, sign_key=sign_key)
        if remote is not None:
            same_registry = push_target is not None and push_target.registry == remote.options.registry
            remote.flush(mount_from=push_target.path if same_registry else "")
            report.remote_cache = remote.record()
    finally:
        atomic.write_text(out_dir / REPORT_NAME, report.to_json())
    return report


def _classic_build(plan: BuildPlan, engine: Engine, context, labels: dict[str, str], report: BuildReport,
                   log: EventLog, timer: PhaseTimer) -> None:
    """The documented fallback (`--builder dockerfile`): the rendered Dockerfile through the
    engine's classic builder, for an engine on another host, which the assembler cannot hand a
    staged folder to. Its image ID and history differ from build to build."""
    with timer("image"):
        existing = engine.image(plan.tag)
        existing_labels = (existing or {}).get("Config", {}).get("Labels") or {}
        if existing and existing_labels.get(CONTEXT_LABEL) == context.digest and \
                existing_labels.get(BUILDER_LABEL, "dockerfile") == "dockerfile":
            log.emit("image", f"image cache hit: {plan.tag} was built from this exact context")
            report.cache["image"] = "hit"
            report.image_id, report.size_bytes = existing["Id"], int(existing.get("Size", 0))
        else:
            report.cache["image"] = "miss"
            # superseded images go first: their space is what this build needs
            report.pruned += prune_superseded(engine, plan, (existing or {}).get("Id", ""), log)
            report.pruned += make_room(engine, image=plan.tag, wheel_bytes=wheelhouse_bytes(context.directory),
                                       free_layer_cache=lambda: prune_builder_stages(engine, plan, keep=0), log=log)
            built = engine.build(context.directory, plan.tag, log=log, labels=labels)
            report.image_id, report.size_bytes = built.id, built.size_bytes
            report.steps = [(step[:80], round(secs, 2)) for step, secs in built.step_seconds]


def fetch_named_wheels(resolution: Resolution, plan: BuildPlan, cache: CacheLayout, log: EventLog,
                       report: BuildReport) -> None:
    """What a registry resolution left undownloaded, for a stage that needs the files after all."""
    fetched = wheel_files(resolution, plan, cache, log)
    kernel_stage.fetch_pinned_wheels(plan, cache, log)
    report.cache["wheelhouse"] = wheelhouse_state(fetched)


def wheelhouse_state(resolution: Resolution) -> str:
    if resolution.source == "registry":
        return f"hit registry ({len(resolution.wheels)} wheels named" + \
            ("; downloaded: a stage needed them)" if resolution.files else "; none downloaded)")
    return f"{'hit' if resolution.cache_hit else 'miss'} ({len(resolution.wheels)} wheels)"


def base_identities(plan: BuildPlan, provider: Bases) -> dict[str, str]:
    """What the lock records of each base: the image ID (the canonical config's digest for a
    bootstrapped base), its layers' diffIDs (the root filesystem itself) and the digest of the
    deb lock it was bootstrapped from."""

    found: dict[str, str] = {}
    for stage, ref in (("builder", plan.spec.builder_base), ("runtime", plan.spec.runtime_base)):
        found[stage] = provider.found[stage].id
        found[f"{stage}.rootfs"] = ",".join((provider.info(stage).get("RootFS") or {}).get("Layers") or [])
        lock = debs_lock.load_lock(ref.bootstrap.path) if ref.bootstrap else None
        found[f"{stage}.debs-lock"] = lock.sha256() if lock else ""
    return found


def prune_superseded(engine: Engine, plan: BuildPlan, keep_id: str, log: EventLog) -> list[str]:
    """Remove what this image's earlier builds left: older images of this name (other plan
    keys, or the same tag rebuilt, which leaves the old one untagged) and older builder
    stages (multi-GB intermediates a multi-stage build leaves untagged). They fill the disk
    the next build needs. The newest builder stage stays as the next build's layer cache.
    An image still used by a container is kept."""
    pruned = []
    for image in engine.images_with_label(f"{IMAGE_LABEL}={plan.spec.name}"):
        if image.get("Id") == keep_id:
            continue
        labels = image.get("Labels") or {}
        if labels.get(STAGE_LABEL) == "builder":
            continue   # handled below
        tags = [t for t in image.get("RepoTags") or [] if t != "<none>:<none>"]
        for tag in tags or [image["Id"]]:
            if tag.startswith(f"{plan.spec.name}:") or tag == image["Id"]:
                if engine.remove(tag):
                    pruned.append(tag)
    pruned += prune_builder_stages(engine, plan, keep=1)
    if pruned:
        log.emit("prune", f"removed superseded images: {', '.join(pruned)}")
    return pruned


def prune_builder_stages(engine: Engine, plan: BuildPlan, *, keep: int) -> list[str]:
    """This image's builder stages but the newest `keep` (the layer cache of the next build)."""
    stages = engine.images_with_label(f"{STAGE_LABEL}=builder")   # newest first
    mine = [i for i in stages if (i.get("Labels") or {}).get(IMAGE_LABEL) == plan.spec.name]
    return [f"{plan.spec.name} builder stage {image['Id'][7:19]}"
            for image in mine[keep:] if engine.remove(image["Id"])]


def wheelhouse_bytes(context_dir: Path) -> int:
    return sum(p.stat().st_size for p in (context_dir / "wheelhouse").glob("*.whl"))
