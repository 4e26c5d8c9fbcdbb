"""The remote cache: compiled kernels and assembled layers shared through one OCI repository.

Lookup order is local cache, then the registry, then compile/assemble. A registry entry is
used only once it proved itself: its manifest has the expected artifact type and media types,
its signature verifies with `--cache-key` (or `--trust-unsigned-cache` said not to ask), every
byte downloaded matches the digests (and, for a layer, the diffID) it was pushed with, and a
kernel's meta.json and wheel pass the checks a fresh compile gets against the key's own inputs
(build/kernels/acceptance.py). An entry that fails any of that, or that the image's check
stage later refuses (`refuse_kernel`), is named in one WARN line and the build makes its own;
it is never used again in this build and never overwritten. A registry that is down, slow or
refusing costs one WARN line and at most one timeout: from then on this build runs without it.

What a build used is queued (`queue_kernel`, `queue_layer`) and pushed by `flush`: the kernels
right after the kernel stage (what a build compiled is shared even when a later stage fails),
the layers at the end, after the image push, so a layer blob the image push already stored is
found by a HEAD, or mounted from the image's repository, instead of being sent again. Nothing
`flush` meets fails the build: a registry error marks the cache unavailable, an entry that
cannot be read here is one WARN and is skipped.
"""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from build.kernels.acceptance import Expected
from build.kernels.store import KernelEntry, KernelStore
from build.oci.image import sha256_digest
from build.oci.layercache import CachedLayer, LayerCache
from build.publish.registry import RegistryError
from build.remote_cache.base_entries import BaseMeta, ExpectedBase, base_manifest, fetch_base_layer, read_base_meta
from build.remote_cache.kernel_entries import fetch_kernel, kernel_manifest, read_meta
from build.remote_cache.layer_entries import fetch_layer, layer_manifest
from build.remote_cache.options import RemoteCacheOptions
from build.remote_cache.resolution_entries import read_resolution, resolution_manifest
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.wire import (
    BASE_ARTIFACT,
    BASE_LIMITS,
    EMPTY_BLOB,
    KERNEL_ARTIFACT,
    KERNEL_LIMITS,
    LAYER_ARTIFACT,
    LAYER_LIMITS,
    RESOLUTION_ARTIFACT,
    RESOLUTION_LIMITS,
    Descriptor,
    Untrusted,
    WireError,
    base_tag,
    kernel_tag,
    layer_tag,
    parse_manifest,
    resolution_tag,
)
from build.resolve import BuildPlan
from build.wheelhouse import Wheel
from contracts.events import EventLog

__all__ = ["RemoteCache", "RemoteCacheOptions"]


# writes a base's one layer, gzipped, into the folder it is given: (base.json's fields, the blob)
BaseExport = Callable[[Path], tuple[BaseMeta, Path]]


@dataclass(frozen=True)
class RegistryBase:
    """A base entry whose base.json passed (the layer is fetched only if a stage loads the base)."""
    meta: BaseMeta
    layers: dict[str, Descriptor]


@dataclass
class _Pending:
    kernels: dict[str, KernelEntry] = field(default_factory=dict)
    layers: dict[str, CachedLayer] = field(default_factory=dict)
    bases: dict[str, BaseExport] = field(default_factory=dict)
    resolutions: dict[str, tuple[tuple[Wheel, ...], int]] = field(default_factory=dict)


class RemoteCache:
    def __init__(self, options: RemoteCacheOptions, log: EventLog, *, client: CacheRegistry | None = None):
        self.options, self.log = options, log
        self.client = client or CacheRegistry(options.registry, timeout=options.timeout, budget=options.budget)
        self.unavailable = ""                   # why the registry is no longer asked, once it failed
        self.refused: dict[str, str] = {}       # tag -> why its entry was not used (or not overwritten)
        self.hits: list[str] = []
        self.pushed: list[str] = []
        self.already_there: list[str] = []
        self.pending = _Pending()
        self.signed_by = ""
        self.entry_bytes: dict[str, int] = {}    # for `--plan`: tag -> the bytes of an entry's blobs
        if options.public_key is not None:
            from build import signing  # cryptography only with a key: a bare GPU host (build-here) has none

            self.signed_by = signing.key_id(options.public_key)

    @property
    def path(self) -> str:
        return self.options.path

    # ---- what went wrong, once ----------------------------------------------------------------

    def _lost(self, exc: RegistryError, tag: str = "") -> None:
        """`tag`: the entry being read when it happened (a transfer cut off mid-pull is named)."""
        if not self.unavailable:
            self.unavailable = str(exc)
            during = f" while reading entry {tag}" if tag else ""
            self.log.emit("cache", f"WARN: remote cache {self.options.repository} unavailable{during}: {exc}; "
                                   "this build goes on without it")

    def _refuse(self, tag: str, why: str, doing: str) -> None:
        if tag not in self.refused:
            self.refused[tag] = why
            self.log.emit("cache", f"WARN: remote cache entry {tag} refused: {why}; {doing}")

    def _usable(self) -> bool:
        return not self.unavailable

    # ---- reading ------------------------------------------------------------------------------

    def _open(self, tag: str, artifact: str, limits: dict[str, int]) -> dict[str, Descriptor] | None:
        """The entry's layers once its manifest and signature checked out; None when there is
        none. WireError / Untrusted say why it cannot be used; RegistryError, why nothing can."""
        data = self.client.get_manifest(self.path, tag)
        if data is None:
            return None
        layers = parse_manifest(data, artifact, limits)
        if self.options.public_key is not None:
            from build.remote_cache.trust import verify_entry  # signing code only when it is used

            verify_entry(self.client, self.path, self.options.repository, sha256_digest(data),
                         self.options.public_key)
        return layers

    def _read(self, tag_of, key: str, artifact: str, limits: dict[str, int], fetch, doing: str):
        if not self.options.reads or not self._usable():
            return None
        try:
            tag = tag_of(key)
        except WireError as exc:   # refused before any request
            self._refuse(str(key)[:80].encode("unicode_escape").decode(), str(exc), doing)
            return None
        if tag in self.refused:    # refused once (and named then): never fetched again by this build
            return None
        try:
            layers = self._open(tag, artifact, limits)
            if layers is None:
                return None
            found = fetch(layers)
        except RegistryError as exc:
            self._lost(exc, tag)
            return None
        except (Untrusted, ValueError, OSError) as exc:
            self._refuse(tag, str(exc), doing)
            return None
        self.hits.append(tag)
        trust = f"signature by {self.signed_by[:23]}... verified" if self.signed_by else \
            "UNSIGNED, used on --trust-unsigned-cache"
        self.log.emit("cache", f"remote cache hit: {tag[:23]}... ({trust})")
        return found

    def fetch_kernel(self, store: KernelStore, expected: Expected) -> KernelEntry | None:
        """The kernel entry for `expected.key` from the registry, checked against the key's own
        inputs and published into `store` (the caller holds `store.lock(key)`), or None: compile it."""
        provenance = {"fetched_from": self.options.repository,
                      "fetched_signature": f"verified {self.signed_by}" if self.signed_by
                      else "none (--trust-unsigned-cache)"}
        return self._read(kernel_tag, expected.key, KERNEL_ARTIFACT, KERNEL_LIMITS,
                          lambda layers: fetch_kernel(self.client, self.path, expected, layers, store, provenance),
                          "compiling it here instead")

    def refuse_kernel(self, key: str, why: str) -> None:
        """An entry this build fetched that failed a later check (the image's check stage): named
        in a WARN, recorded in the report, never fetched again by this build nor overwritten."""
        self._refuse(kernel_tag(key), why, "evicted from the local cache, compiling it here instead")

    def fetch_layer(self, cache: LayerCache, key: str, expected: dict | None = None) -> CachedLayer | None:
        """The layer for `key` from the registry, published into `cache`, or None: assemble it.
        `expected`: what this build makes for that key (its name, created_by and mtime); an entry
        whose layer.json says otherwise is refused."""
        return self._read(layer_tag, key, LAYER_ARTIFACT, LAYER_LIMITS,
                          lambda layers: fetch_layer(self.client, self.path, key, layers, cache, expected),
                          "assembling it here instead")

    def fetch_base(self, expected: ExpectedBase) -> RegistryBase | None:
        """The entry of this bootstrapped base, once its signature and base.json passed; its layer
        is not downloaded here (`fetch_base_layer`). None: bootstrap it."""
        return self._read(base_tag, expected.spec_sha256, BASE_ARTIFACT, BASE_LIMITS,
                          lambda layers: RegistryBase(read_base_meta(self.client, self.path, expected, layers),
                                                      layers),
                          "bootstrapping it here instead")

    def fetch_base_layer(self, found: RegistryBase, dest: Path) -> bool:
        """The base's layer into `dest` (digest and diffID checked); False, after one WARN, when
        it cannot be had: the caller bootstraps the base instead."""
        tag = base_tag(found.meta.spec_sha256)
        if not self._usable():
            return False
        try:
            fetch_base_layer(self.client, self.path, found.meta, dest)
        except (RegistryError, ValueError, OSError) as exc:   # cut off mid-pull too: the registry stays in use
            self._refuse(tag, f"its layer did not arrive whole and checked ({exc})", "bootstrapping it here instead")
            return False
        return True

    def refuse_base(self, spec_sha256: str, why: str) -> None:
        """A base entry that the engine would not load as its config says (named, not used again)."""
        self._refuse(base_tag(spec_sha256), why, "bootstrapping it here instead")

    def fetch_resolution(self, key: str, plan: BuildPlan) -> tuple[tuple[Wheel, ...], int] | None:
        """The image's closure and the newest entry time of its wheels and its pinned kernel wheels,
        from the registry (`key`: resolution_entry_key(plan)); None: resolve it."""
        return self._read(resolution_tag, key, RESOLUTION_ARTIFACT, RESOLUTION_LIMITS,
                          lambda layers: read_resolution(self.client, self.path, key, plan, layers),
                          "resolving it with pip instead")

    def base_state(self, expected: ExpectedBase) -> tuple[str, int]:
        """For `--plan`: ("in registry" | "miss ...", the bytes of its layer were it loaded)."""
        metas: list[BaseMeta] = []
        state = self._state(base_tag, expected.spec_sha256, BASE_ARTIFACT, BASE_LIMITS, "it would be bootstrapped",
                            lambda layers: metas.append(read_base_meta(self.client, self.path, expected, layers))
                            or "in registry")
        return state, (metas[0].size if metas else 0)

    def resolution_state(self, key: str, plan: BuildPlan) -> str:
        """For `--plan`: "in registry" once resolution.json passed, else "miss ..."."""
        return self._state(resolution_tag, key, RESOLUTION_ARTIFACT, RESOLUTION_LIMITS, "it would be resolved",
                           lambda layers: read_resolution(self.client, self.path, key, plan, layers) and "in registry")

    def refuse_layer(self, key: str, why: str) -> None:
        """A layer this build fetched whose diffID check (run while the image loaded) failed."""
        self._refuse(layer_tag(key), why, "assembling it here instead")

    def kernel_state(self, expected: Expected) -> str:
        """For `--plan`: "in registry, not yet checked (...)" once the entry's signature and its
        meta.json passed what the build checks before downloading the wheel; "miss", or why the
        registry will not be used. Never "hit registry": the wheel's own SASS, tags and import are
        checked only once a build downloads it."""
        def meta_checked(layers: dict) -> str:
            read_meta(self.client, self.path, expected, layers)
            # the wheel's SASS, tags and import are checked only once a build downloads it
            return "in registry, not yet checked (signature and meta.json match; the wheel is checked when fetched)"

        return self._state(kernel_tag, expected.key, KERNEL_ARTIFACT, KERNEL_LIMITS, "it would be compiled",
                           meta_checked)

    def layer_state(self, key: str) -> str:
        """For `--plan`, a layer's: "hit registry", "miss", or why the registry will not be used."""
        return self._state(layer_tag, key, LAYER_ARTIFACT, LAYER_LIMITS, "it would be assembled")

    def _state(self, tag_of, key: str, artifact: str, limits: dict[str, int], doing: str, found=None) -> str:
        """`found(layers)`: what the plan says of an entry whose manifest and signature passed,
        once it checked what it can without a download (raising what the build would refuse)."""
        if not self.options.reads:
            return "miss (registry not read)"
        if not self._usable():
            return "miss (registry unavailable)"
        try:
            tag = tag_of(key)
        except WireError as exc:
            return f"miss ({exc})"
        try:
            layers = self._open(tag, artifact, limits)
            if layers is None:
                return "miss"
            self.entry_bytes[tag] = sum(d.size for d in layers.values())
            return found(layers) if found is not None else "hit registry"
        except RegistryError as exc:
            self._lost(exc)
            return "miss (registry unavailable)"
        except (Untrusted, ValueError) as exc:
            self._refuse(tag, str(exc), doing)
            return "miss (registry entry refused)"

    # ---- writing ------------------------------------------------------------------------------

    def queue_kernel(self, entry: KernelEntry) -> None:
        self.pending.kernels[entry.key] = entry

    def queue_layer(self, layer: CachedLayer) -> None:
        self.pending.layers[layer.key] = layer

    def queue_base(self, spec_sha256: str, export: BaseExport) -> None:
        """A base this build used: pushed, exported from the engine, only if the registry lacks it."""
        self.pending.bases[spec_sha256] = export

    def queue_resolution(self, key: str, wheels: tuple[Wheel, ...], epoch: int) -> None:
        self.pending.resolutions[key] = (wheels, epoch)

    def flush(self, *, mount_from: str = "") -> None:
        """Push every queued entry the registry lacks; never raises for the registry or an entry.
        `mount_from`: a repository on the same registry the image was just pushed to (its layer
        blobs are mounted from there)."""
        if not self.options.writes:
            return
        pending, self.pending = self.pending, _Pending()
        before = len(self.pushed), len(self.already_there)
        for entry in pending.kernels.values():
            self._push(kernel_tag, entry.key, KERNEL_ARTIFACT, KERNEL_LIMITS, lambda e=entry: kernel_manifest(e))
        for layer in pending.layers.values():
            self._push(layer_tag, layer.key, LAYER_ARTIFACT, LAYER_LIMITS, lambda c=layer: layer_manifest(c),
                       mount_from=mount_from)
        for key, (wheels, epoch) in pending.resolutions.items():
            self._push(resolution_tag, key, RESOLUTION_ARTIFACT, RESOLUTION_LIMITS,
                       lambda k=key, w=wheels, e=epoch: resolution_manifest(k, w, e))
        for key, export in pending.bases.items():
            scratch = Path(tempfile.mkdtemp(prefix="ftimage-base-export-"))
            try:   # the base's layer is gzipped only when the registry lacks the entry (`make`)
                self._push(base_tag, key, BASE_ARTIFACT, BASE_LIMITS,
                           lambda x=export, d=scratch: base_manifest(*x(d)))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        pushed, there = len(self.pushed) - before[0], len(self.already_there) - before[1]
        if pushed or there:
            self.log.emit("cache", f"remote cache {self.options.repository}: pushed {pushed} entries, "
                                   f"{there} already there")

    def _push(self, tag_of, key: str, artifact: str, limits: dict[str, int], make, *, mount_from: str = "") -> None:
        if not self._usable():
            return
        try:
            tag = tag_of(key)
            if tag in self.refused:
                return     # an invalid entry is reported, never overwritten
            if self._valid_entry_there(tag, artifact, limits):
                self.already_there.append(tag)
                return
            if tag in self.refused:
                return     # found invalid just now
            manifest, blobs = make()
            self.client.push_bytes(self.path, EMPTY_BLOB)
            for descriptor, source in blobs:
                if isinstance(source, bytes):
                    self.client.push_bytes(self.path, source)
                else:
                    self.client.push_file(self.path, source, descriptor.digest, descriptor.size, mount_from)
            digest = sha256_digest(manifest)
            if self.options.sign_key is not None:   # first, so the tag never names an unsigned entry
                from build.remote_cache.trust import sign_entry  # signing code only when it is used

                sign_entry(self.client, self.path, self.options.repository, digest, self.options.sign_key)
            self.client.put_manifest(self.path, tag, manifest)
            self.pushed.append(tag)
        except RegistryError as exc:
            self._lost(exc)
        except (OSError, ValueError) as exc:    # the local entry went unreadable, or a key is not one
            self.log.emit("cache", f"WARN: remote cache: {str(key)[:64]} not pushed: {exc}")

    def _valid_entry_there(self, tag: str, artifact: str, limits: dict[str, int]) -> bool:
        """Whether `tag` already holds a valid entry (left alone); an invalid one is recorded in
        `refused`, so it is reported and not overwritten."""
        data = self.client.get_manifest(self.path, tag)
        if data is None:
            return False
        doing = "left as it is (not overwritten)"
        try:
            layers = parse_manifest(data, artifact, limits)
            if self.options.sign_key is not None:
                from build.remote_cache.trust import verify_entry  # signing code only when it is used

                verify_entry(self.client, self.path, self.options.repository, sha256_digest(data),
                             self.options.sign_key.public_key())
        except (Untrusted, ValueError) as exc:
            self._refuse(tag, str(exc), doing)
            return False
        missing = [d.digest for d in layers.values() if not self.client.has_blob(self.path, d.digest)]
        if missing:
            self._refuse(tag, f"the manifest points at blob {missing[0][:19]}, which the registry does not have",
                         doing)
            return False
        return True

    # ---- the record ---------------------------------------------------------------------------

    def record(self) -> dict:
        """What build-report.json keeps under `remote_cache` (no credentials: none are ever held here)."""
        trust = f"signed by {self.signed_by}" if self.signed_by else \
            ("UNSIGNED (--trust-unsigned-cache)" if self.options.trust_unsigned else "not read")
        return {"repository": self.options.repository, "read": self.options.reads, "trust": trust,
                "written": self.options.writes, "hits": len(self.hits), "pushed": len(self.pushed),
                "already_there": len(self.already_there), "refused": dict(sorted(self.refused.items())),
                "unavailable": self.unavailable, "bytes_pulled": self.client.bytes_pulled,
                "bytes_pushed": self.client.bytes_pushed, "timeout_s": self.options.timeout,
                "budget_s": self.options.budget, "registry_s": round(self.client.spent, 1)}

    def lock_record(self) -> dict[str, str]:
        """What the image's lock records of this cache (build.lock.json's `build`): that entries
        were used without a verified signature, only when --trust-unsigned-cache was given;
        nothing otherwise, so the lock, and the image ID, are those of a build without it."""
        return {"remote_cache_trust": "unsigned"} if self.options.trust_unsigned else {}
