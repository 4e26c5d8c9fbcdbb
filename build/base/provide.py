"""The two bases of a build, from wherever is cheapest, and in the engine only when a stage needs them.

A bootstrapped base comes, in this order, from the engine (already loaded), from the remote
cache (its `base-<spec digest>` entry) or from debootstrap. Most of a build needs only what
the lock, the SBOM and the layer keys record of a base: its image ID, diffIDs, time, Env,
labels and Debian packages. A registry entry's base.json carries all of that, so a build whose
layers are all in the registry never downloads the base at all. `loaded(stage)` puts a base
in the engine the first time a stage needs it there (a base layer or venv to assemble, a
kernel to compile, a Dockerfile build): the entry's layer, checked on the way and loaded with
the config's own ID, or, if that fails, debootstrap, as a build without a registry does.
"""
from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from build.base import debs_lock
from build.base.bootstrap import BaseImage, base_tag, bootstrap, ensure_base
from build.cache import CacheLayout
from build.context.dpkg_status import DebPackage, base_packages
from build.engine import Engine
from build.errors import BuildFailure
from build.oci.docker_archive import LayerFile, archive_chunks
from build.resolve import BuildPlan, digest
from build.spec import BaseRef
from contracts.events import EventLog

STAGES = ("builder", "runtime")


@dataclass(frozen=True)
class RegistryBaseImage(BaseImage):
    """A base known from its registry entry and not (yet) in the engine."""
    entry: object = None       # the RegistryBase (build/remote_cache), for a later load


def expected_base(ref: BaseRef):
    from build.remote_cache.base_entries import ExpectedBase

    base = ref.bootstrap
    lock = debs_lock.load_lock(base.path)
    return ExpectedBase(name=base.name, spec_sha256=digest(base.spec_dict()),
                        debs_lock_sha256=lock.sha256() if lock else "")


def inspect_from_config(image_id: str, config: dict) -> dict:
    """What the engine's inspect would say of an image with this config: the fields a build reads."""
    inner = config.get("config") or {}
    return {"Id": image_id, "Created": config.get("created", ""),
            "Config": {"Env": list(inner.get("Env") or []), "Labels": dict(inner.get("Labels") or {})},
            "RootFS": {"Type": "layers", "Layers": list((config.get("rootfs") or {}).get("diff_ids") or [])}}


class Bases:
    def __init__(self, plan: BuildPlan, engine: Engine, cache: CacheLayout, log: EventLog, remote=None):
        self.plan, self.engine, self.cache, self.log, self.remote = plan, engine, cache, log, remote
        self.refs = {"builder": plan.spec.builder_base, "runtime": plan.spec.runtime_base}
        self.found: dict[str, BaseImage] = {}
        self.states: dict[str, str] = {}

    def find(self) -> dict[str, BaseImage]:
        """Each base, without loading a registry one: what the report says of each, in `states`."""
        for stage in STAGES:
            self.found[stage] = self._find(stage)
        return dict(self.found)

    def _find(self, stage: str) -> BaseImage:
        ref = self.refs[stage]
        if ref.bootstrap is not None and self.remote is not None:
            held = self.engine.image(base_tag(ref.bootstrap))
            if held is None:
                entry = self.remote.fetch_base(expected_base(ref))
                if entry is not None:
                    self.states[stage] = "hit registry (base.json only; its layer is fetched if a stage loads it)"
                    return RegistryBaseImage(ref=base_tag(ref.bootstrap), id=entry.meta.image_id, reused=True,
                                             entry=entry)
        base = ensure_base(ref, self.engine, self.cache, self.log)
        self.states[stage] = "hit" if base.reused else "miss (bootstrapped)"
        return base

    def info(self, stage: str) -> dict:
        """The base's inspect fields (Id, Created, Config.Env/Labels, RootFS.Layers)."""
        base = self.found[stage]
        if isinstance(base, RegistryBaseImage):
            return inspect_from_config(base.id, json.loads(base.entry.meta.config))
        info = self.engine.image(base.ref)
        if info is None:
            raise BuildFailure(f"the {stage} base {base.ref} left the engine during this build (removed by "
                               "another process: a prune, `docker rmi`?)", "build again; it is made again first")
        return info

    def packages(self, stage: str) -> tuple[DebPackage, ...]:
        base = self.found[stage]
        if isinstance(base, RegistryBaseImage):
            return base.entry.meta.packages
        return base_packages(self.engine, base.ref)

    def loaded(self, stage: str) -> str:
        """The base's ref, in the engine: a registry base is loaded now (or bootstrapped if its
        layer cannot be had, or the engine gives it another ID)."""
        base = self.found[stage]
        if not isinstance(base, RegistryBaseImage):
            return base.ref
        ref = self.refs[stage]
        self.log.emit("bootstrap", f"loading the {stage} base {base.ref} from the registry: a stage needs it "
                                   "in the engine")
        if self._load(base):
            self.states[stage] = "hit registry (loaded)"
            loaded = BaseImage(ref=base.ref, id=base.id, reused=True)
        else:
            loaded = bootstrap(ref.bootstrap, self.engine, self.cache, self.log)
            self.states[stage] = "miss (bootstrapped: the registry's layer was refused)"
        self.found[stage] = loaded
        return loaded.ref

    def _load(self, base: RegistryBaseImage) -> bool:
        meta = base.entry.meta
        with self.cache.scratch_dir("base") as tmp:
            blob = Path(tmp) / "rootfs.tar.gz"
            if not self.remote.fetch_base_layer(base.entry, blob):
                return False
            layer = LayerFile(meta.diff_id, blob, blob.stat().st_size)   # the engine gunzips a layer itself
            try:
                image_id = self.engine.load_stream(archive_chunks(meta.config, base.ref, [layer]), base.ref)
            except BuildFailure as exc:
                self.remote.refuse_base(meta.spec_sha256, f"the engine would not load it: {str(exc)[:200]}")
                return False
        if image_id != meta.image_id:
            self.engine.remove(base.ref)
            self.remote.refuse_base(meta.spec_sha256, f"the engine gave it the ID {image_id[:19]}, not its config's "
                                                      f"{meta.image_id[:19]}")
            return False
        return True

    def share(self) -> None:
        """Queue each bootstrapped base this build holds in the engine for the registry (pushed only
        where the registry lacks it)."""
        if self.remote is None:
            return
        for stage in STAGES:
            ref, base = self.refs[stage], self.found[stage]
            if ref.bootstrap is None or isinstance(base, RegistryBaseImage):
                continue
            expected = expected_base(ref)
            self.remote.queue_base(expected.spec_sha256,
                                   lambda folder, e=expected, b=base: export_base(self.engine, b, e, folder))


def export_base(engine: Engine, base: BaseImage, expected, folder: Path):
    """(base.json's fields, the gzipped layer) of a base the engine holds, for its registry entry."""
    from build.remote_cache.base_entries import BaseMeta, export_base_layer

    info = engine.image(base.ref) or {}
    diff_ids = list((info.get("RootFS") or {}).get("Layers") or [])
    if len(diff_ids) != 1:
        raise ValueError(f"the base {base.ref} has {len(diff_ids)} layers in the engine, not one")
    saved = folder / "base.tar"
    try:
        engine.save(base.ref, saved)
    except BuildFailure as exc:
        raise OSError(str(exc)) from None
    config = _config_bytes(saved, base.id)
    blob = folder / "rootfs.tar.gz"
    blob_digest, size = export_base_layer(saved, diff_ids[0], blob)
    saved.unlink()
    meta = BaseMeta(name=expected.name, spec_sha256=expected.spec_sha256, debs_lock_sha256=expected.debs_lock_sha256,
                    config=config, diff_id=diff_ids[0], digest=blob_digest, size=size,
                    packages=base_packages(engine, base.ref))
    return meta, blob


def _config_bytes(saved: Path, image_id: str) -> bytes:
    """The image's config exactly as the engine keeps it: its sha256 is the image ID."""
    with tarfile.open(saved) as archive:
        manifest = json.load(archive.extractfile("manifest.json"))
        member = archive.extractfile(manifest[0]["Config"])
        data = member.read(1 << 20) if member else b""
    if "sha256:" + hashlib.sha256(data).hexdigest() != image_id:
        raise ValueError(f"the engine's saved config of {image_id[:19]} does not hash to its ID")
    return data
