"""A bootstrapped base as a remote artifact, and back: so a fresh runner never runs debootstrap.

The entry (`base-<key>`, key = the digest of the base's spec, its deb lock's sha256 among it)
holds two layers:
  * the base's one root filesystem layer, gzipped (the image layer media type);
  * base.json: the base's name, spec digest and deb lock digest, its image config exactly as
    the bootstrap wrote it (the image ID is that config's sha256), the layer's diffID and
    compressed digest, and the Debian packages its dpkg status lists (what the SBOM names).

A build that needs only what the lock and the layer keys record of a base (its ID, its
diffIDs, its time, its Env, its packages) reads base.json alone, a few KiB: with every layer
of the image in the registry, the base itself is never downloaded. Its layer is fetched only
when a stage needs the base in the engine (a layer to assemble, a kernel to compile), streamed
and hashed twice on the way (digest, and the diffID of the tar inside), then loaded; the
engine must give it the config's ID.

base.json is checked before anything of it is used: every field typed and bounded, the spec
and deb lock digests this build's own, the config naming that spec and that diffID, and each
package name, version and architecture in Debian policy's grammar (they reach the SBOM).
"""
from __future__ import annotations

import hashlib
import json
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from build.context.dpkg_status import ARCH, NAME, VERSION, DebPackage
from build.oci.blockgzip import ParallelGzip
from build.oci.image import canonical, sha256_digest
from build.oci.tarlayer import GZIP_LEVEL, Digesting
from build.remote_cache.layer_entries import _DiffId
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.wire import (
    BASE_ARTIFACT,
    BASE_MEDIA,
    BASE_META_MEDIA,
    DIGEST,
    MAX_META,
    Descriptor,
    WireError,
    build_manifest,
    typed_document,
)

FIELDS = {"name": str, "spec_sha256": str, "debs_lock_sha256": str, "config": str, "diff_id": str,
          "digest": str, "size": int, "packages": list}
# the labels a bootstrapped base's config carries (build/base/bootstrap.py writes them)
SPEC_LABEL, ROOTFS_LABEL, NAME_LABEL = "io.ftimage.base.spec-sha256", "io.ftimage.base.rootfs", "io.ftimage.base.name"
MAX_PACKAGES = 4096


@dataclass(frozen=True)
class ExpectedBase:
    """What this build's spec says of a bootstrapped base: an entry must say the same."""
    name: str
    spec_sha256: str            # the entry's key
    debs_lock_sha256: str       # "" for a base without a deb lock


@dataclass(frozen=True)
class BaseMeta:
    name: str
    spec_sha256: str
    debs_lock_sha256: str
    config: bytes               # the image config; the image ID is its sha256
    diff_id: str
    digest: str                 # the gzipped layer's
    size: int
    packages: tuple[DebPackage, ...]

    @property
    def image_id(self) -> str:
        return sha256_digest(self.config)

    @property
    def config_document(self) -> dict:
        return json.loads(self.config)

    def to_bytes(self) -> bytes:
        return canonical({"name": self.name, "spec_sha256": self.spec_sha256,
                          "debs_lock_sha256": self.debs_lock_sha256, "config": self.config.decode(),
                          "diff_id": self.diff_id, "digest": self.digest, "size": self.size,
                          "packages": [[p.name, p.version, p.arch] for p in self.packages]})


def base_manifest(meta: BaseMeta, blob: Path) -> tuple[bytes, list[tuple[Descriptor, Path | bytes]]]:
    raw = meta.to_bytes()
    blobs: list[tuple[Descriptor, Path | bytes]] = [(Descriptor(BASE_MEDIA, meta.digest, meta.size), blob),
                                                    (Descriptor.of(BASE_META_MEDIA, raw), raw)]
    return build_manifest(BASE_ARTIFACT, [d for d, _ in blobs]), blobs


def _packages(value: list) -> tuple[DebPackage, ...]:
    if len(value) > MAX_PACKAGES:
        raise WireError(f"its base.json lists {len(value)} packages (at most {MAX_PACKAGES})")
    found = []
    for row in value:
        if not (isinstance(row, list) and len(row) == 3 and all(isinstance(x, str) for x in row)
                and NAME.fullmatch(row[0]) and VERSION.fullmatch(row[1]) and ARCH.fullmatch(row[2])):
            raise WireError(f"its base.json lists a package {str(row)[:80]!r} outside Debian's grammar")
        found.append(DebPackage(*row))
    return tuple(sorted(found))


def _check_config(config: bytes, meta: dict, expected: ExpectedBase) -> None:
    try:
        document = json.loads(config)
        diff_ids = document["rootfs"]["diff_ids"]
        labels = document["config"]["Labels"]
        created = document["created"]
    except (ValueError, TypeError, KeyError):
        raise WireError("its base.json's config is not an image config with a rootfs, labels and a time") from None
    if diff_ids != [meta["diff_id"]]:
        raise WireError("its config's root filesystem is not the layer base.json names")
    if not isinstance(labels, dict) or labels.get(SPEC_LABEL) != expected.spec_sha256 or \
            labels.get(ROOTFS_LABEL) != meta["diff_id"] or labels.get(NAME_LABEL) != expected.name:
        raise WireError("its config's labels name another base spec, name or root filesystem")
    if not isinstance(created, str) or len(created) > 64:
        raise WireError("its config's `created` is not a time")


def read_base_meta(client: CacheRegistry, path: str, expected: ExpectedBase,
                   layers: dict[str, Descriptor]) -> BaseMeta:
    """base.json of the entry, checked against this build's base; WireError says what is wrong."""
    blob = layers[BASE_MEDIA]
    raw = client.small_blob(path, layers[BASE_META_MEDIA].digest, MAX_META)
    meta = typed_document(raw, FIELDS, "base.json")
    if meta["spec_sha256"] != expected.spec_sha256 or meta["name"] != expected.name:
        raise WireError(f"its base.json is the entry of base {meta['name'][:40]!r} spec {meta['spec_sha256'][:12]!r}, "
                        f"not {expected.name} spec {expected.spec_sha256[:12]}")
    if meta["debs_lock_sha256"] != expected.debs_lock_sha256:
        raise WireError(f"its base.json names another deb lock ({meta['debs_lock_sha256'][:12] or 'none'!s}), "
                        f"not this base's ({expected.debs_lock_sha256[:12] or 'none'})")
    if not DIGEST.fullmatch(meta["diff_id"]) or meta["digest"] != blob.digest or meta["size"] != blob.size:
        raise WireError("its base.json describes another layer than its manifest's")
    config = meta["config"].encode()
    _check_config(config, meta, expected)
    return BaseMeta(name=meta["name"], spec_sha256=meta["spec_sha256"], debs_lock_sha256=meta["debs_lock_sha256"],
                    config=config, diff_id=meta["diff_id"], digest=meta["digest"], size=meta["size"],
                    packages=_packages(meta["packages"]))


def fetch_base_layer(client: CacheRegistry, path: str, meta: BaseMeta, dest: Path) -> Path:
    """The entry's gzipped layer streamed into `dest`, its digest and its diffID checked on the
    way; WireError (ValueError) says what is wrong, and `dest` is removed then."""
    diff = _DiffId()
    try:
        try:
            client.download(path, meta.digest, meta.size, dest, feed=diff.feed)
        except zlib.error:
            raise WireError("its base layer is not gzip") from None
        if diff.digest() != meta.diff_id:
            raise WireError(f"its base layer's tar has diffID {diff.digest()[:19]}, base.json says {meta.diff_id[:19]}")
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest


def export_base_layer(saved_archive: Path, diff_id: str, dest: Path) -> tuple[str, int]:
    """The one layer of a base the engine saved (`docker save`), gzipped into `dest` (the same
    parallel gzip as the image's layers); (digest, size). ValueError unless the archive holds
    exactly one layer whose tar is `diff_id`: what is pushed is what the lock recorded."""
    with tarfile.open(saved_archive) as archive:
        manifest = json.load(archive.extractfile("manifest.json"))
        names = manifest[0]["Layers"] if isinstance(manifest, list) and manifest else []
        if len(names) != 1:
            raise ValueError(f"the engine's copy of the base has {len(names)} layers, not one")
        source = archive.extractfile(names[0])
        plain = hashlib.sha256()
        with dest.open("wb") as out:
            digest_sink = Digesting(out)
            writer = ParallelGzip(digest_sink, GZIP_LEVEL, observe=plain.update)
            try:
                while chunk := source.read(1 << 20):
                    writer.write(chunk)
                writer.close()
            except BaseException:
                writer.abort()
                raise
    if "sha256:" + plain.hexdigest() != diff_id:
        dest.unlink(missing_ok=True)
        raise ValueError(f"the engine's copy of the base is not the root filesystem {diff_id[:19]} it was made with")
    return "sha256:" + digest_sink.sha.hexdigest(), digest_sink.size

