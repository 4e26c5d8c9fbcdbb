"""An assembled layer's cache entry (the LayerCache's `layers/<key>/`) as a remote artifact, and back.

Pushed: the layer blob itself, with the image's own layer media type, so it is the same blob
(same digest) the image push stores: in the image's repository a HEAD finds it, and from
another repository on the same registry it is mounted instead of sent again; then layer.json.
Fetched: layer.json first (small, bounded, every field checked, and its name, created_by and
mtime compared with what this build makes for that key: they become the image's history, so
an entry that says otherwise would change the image), then the blob, streamed into a
LayerCache staging folder and hashed on the way (its digest). Its diffID (the sha256 of the
decompressed tar, gunzipped chunk by chunk in bounded memory) is checked against layer.json
in the background while the engine loads the image (LayerCache.defer): only once it matches
does LayerCache.settle publish the entry, and a mismatch removes the image from the engine and
refuses the entry (build/oci/runtime_image.py). The engine computes the diffIDs of what it
loads too, and refuses a layer that is not the config's.
"""
from __future__ import annotations

import hashlib
import shutil
import zlib
from pathlib import Path

from build.oci.layercache import BLOB_NAME, META_NAME, CachedLayer, LayerCache
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.wire import (
    DIGEST,
    LAYER_ARTIFACT,
    LAYER_MEDIA,
    LAYER_META_MEDIA,
    MAX_META,
    Descriptor,
    WireError,
    build_manifest,
    typed_document,
)

NAMES = ("base", "venv", "lock", "app")
FIELDS = {"name": str, "diff_id": str, "digest": str, "size": int, "created_by": str, "mtime": int}
INFLATE_STEP = 4 << 20     # bytes of tar produced per inflate call: a gzip bomb cannot fill memory


def layer_manifest(layer: CachedLayer) -> tuple[bytes, list[tuple[Descriptor, Path | bytes]]]:
    meta = (layer.path.parent / META_NAME).read_bytes()
    blobs: list[tuple[Descriptor, Path | bytes]] = [(Descriptor(LAYER_MEDIA, layer.digest, layer.size), layer.path),
                                                    (Descriptor.of(LAYER_META_MEDIA, meta), meta)]
    return build_manifest(LAYER_ARTIFACT, [d for d, _ in blobs]), blobs


def _layer_meta(raw: bytes, blob: Descriptor) -> dict:
    meta = typed_document(raw, FIELDS, "layer.json")
    if meta["name"] not in NAMES:
        raise WireError(f"its layer.json names a {meta['name'][:20]!r} layer")
    if not DIGEST.fullmatch(meta["diff_id"]):
        raise WireError("its layer.json's diff_id is not a sha256 digest")
    if meta["digest"] != blob.digest or meta["size"] != blob.size:
        raise WireError("its layer.json describes another blob than its manifest's layer")
    if meta["mtime"] < 0 or len(meta["created_by"]) > 4096:
        raise WireError("its layer.json's mtime or created_by is out of range")
    return meta


class _DiffId:
    """The sha256 of the tar inside a gzip stream, fed chunk by chunk."""

    def __init__(self):
        self.inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.sha = hashlib.sha256()
        self.trailing = False     # bytes after the gzip stream ended: a second member

    def feed(self, chunk: bytes) -> None:
        if self.inflate.eof:
            self.trailing = self.trailing or bool(chunk)
            return
        data = chunk
        while data and not self.inflate.eof:
            self.sha.update(self.inflate.decompress(data, INFLATE_STEP))
            data = self.inflate.unconsumed_tail

    def digest(self) -> str:
        if not self.inflate.eof or self.inflate.unused_data or self.trailing:
            raise WireError("its layer blob is not one complete gzip stream")
        return "sha256:" + self.sha.hexdigest()


EXPECTED = ("name", "created_by", "mtime")     # what a build may say it expects of a key's layer


def _as_expected(meta: dict, expected: dict | None) -> None:
    for name, value in (expected or {}).items():
        if name in EXPECTED and meta[name] != value:
            raise WireError(f"its layer.json's {name} {str(meta[name])[:80]!r} is not what this build makes for "
                            f"that key ({str(value)[:80]!r})")


def fetch_layer(client: CacheRegistry, path: str, key: str, layers: dict[str, Descriptor],
                cache: LayerCache, expected: dict | None = None) -> CachedLayer:
    """Download one layer (its digest checked on the way) and hand it to the cache to publish
    once its diffID is checked too (`LayerCache.defer`; `settle` publishes or refuses it), so
    the gunzip of the check runs while the engine loads the image, as `docker pull` overlaps its
    download with its extraction. ValueError (WireError) says what the entry gets wrong before
    that, and nothing is left in the cache then. `expected`: the name, created_by and mtime this
    build gives the layer of `key`; layer.json must say the same."""
    blob, meta_blob = layers[LAYER_MEDIA], layers[LAYER_META_MEDIA]
    meta = _layer_meta(client.small_blob(path, meta_blob.digest, MAX_META), blob)
    _as_expected(meta, expected)
    staging = cache.staging()
    try:
        client.download(path, blob.digest, blob.size, staging / BLOB_NAME)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    layer = CachedLayer(key=key, path=cache.root / key / BLOB_NAME, reused=True, source="registry", **meta)
    return cache.defer(key, staging, layer, lambda blob_path: check_diff_id(blob_path, meta["diff_id"]))


def check_diff_id(blob: Path, diff_id: str) -> None:
    """WireError unless the gzip stream in `blob` is one complete member whose tar is `diff_id`."""
    diff = _DiffId()
    try:
        with blob.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                diff.feed(chunk)
    except zlib.error:
        raise WireError("its layer blob is not gzip") from None
    if diff.digest() != diff_id:
        raise WireError(f"its layer's tar has diffID {diff.digest()[:19]}, layer.json says {diff_id[:19]}")
