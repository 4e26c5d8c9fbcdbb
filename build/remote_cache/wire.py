"""The on-the-wire format of the remote cache, in one place: media types, tag names, and the
OCI image manifests of cache entries, built and parsed.

An entry is laid out as `oras push --artifact-type` lays out an artifact: an OCI image
manifest with `artifactType`, the OCI 1.1 empty config (the 2-byte `{}` blob), and one layer per
file, each with its own media type. Everything read back is validated here before any of it is
used: a key is 64 lowercase hex, a tag must hold the artifact type and media types asked for,
each exactly once, and every size is bounded (a manifest that claims a 1 TB wheel is refused
before a byte of it is downloaded).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from build.oci.image import OCI_LAYER, OCI_MANIFEST, canonical, sha256_digest

KERNEL_ARTIFACT = "application/vnd.ftimage.kernel.v1"
LAYER_ARTIFACT = "application/vnd.ftimage.layer.v1"
BASE_ARTIFACT = "application/vnd.ftimage.base.v1"
RESOLUTION_ARTIFACT = "application/vnd.ftimage.resolution.v1"
EMPTY_CONFIG = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB = b"{}"
WHEEL_MEDIA = "application/vnd.ftimage.kernel.wheel.v1+zip"
KERNEL_META_MEDIA = "application/vnd.ftimage.kernel.meta.v1+json"
LAYER_MEDIA = OCI_LAYER            # the image's own layer type: the same blob serves both
LAYER_META_MEDIA = "application/vnd.ftimage.layer.meta.v1+json"
BASE_MEDIA = OCI_LAYER             # a bootstrapped base's one root filesystem layer, gzipped
BASE_META_MEDIA = "application/vnd.ftimage.base.meta.v1+json"
RESOLUTION_MEDIA = "application/vnd.ftimage.resolution.v1+json"
TITLE = "org.opencontainers.image.title"

KEY = re.compile(r"[0-9a-f]{64}")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
MAX_MANIFEST = 64 << 10            # an entry's manifest is well under 1 KiB
MAX_META = 1 << 20                 # meta.json / layer.json
MAX_WHEEL = 8 << 30                # the largest kernel wheel is a few hundred MB
MAX_LAYER = 64 << 30               # a venv layer is gigabytes; nothing real is 64 GiB


class WireError(ValueError):
    """What a stored entry, or a key asked for, gets wrong (the message says what)."""


class Untrusted(Exception):
    """The entry's signature is missing, made by another key, or for another entry (trust.py
    checks it; it is defined here so that naming it imports no signing code)."""


def typed_document(raw: bytes, fields: dict[str, type], what: str) -> dict:
    """A small metadata blob (layer.json, base.json) as JSON holding exactly `fields`, each of its
    type (a bool is not an int); WireError names `what` and the first thing wrong."""
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise WireError(f"its {what} is not JSON") from None
    if not isinstance(meta, dict) or set(meta) != set(fields):
        raise WireError(f"its {what} has fields {sorted(meta)[:10] if isinstance(meta, dict) else '?'}, "
                        f"expected {sorted(fields)}")
    for name, kind in fields.items():
        if not isinstance(meta[name], kind) or isinstance(meta[name], bool):
            raise WireError(f"its {what}'s {name} is not a {kind.__name__}")
    return meta


def check_key(key: str) -> str:
    """A cache key, refused before any request unless it is exactly 64 lowercase hex (no path,
    no control character, nothing a tag or URL could be bent with)."""
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise WireError(f"{str(key)[:80]!r} is not a cache key (64 lowercase hex)")
    return key


def kernel_tag(key: str) -> str:
    return f"kernel-{check_key(key)}"


def layer_tag(key: str) -> str:
    return f"layer-{check_key(key)}"


def base_tag(key: str) -> str:
    """A bootstrapped base's entry, keyed by the digest of its spec (its deb lock's sha256 among it)."""
    return f"base-{check_key(key)}"


def resolution_tag(key: str) -> str:
    """An image's pip resolution, keyed as the local resolution cache keys it (build/wheelhouse.py)."""
    return f"resolution-{check_key(key)}"


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, media_type: str, data: bytes, annotations: dict[str, str] | None = None) -> Descriptor:
        return cls(media_type, sha256_digest(data), len(data), dict(annotations or {}))

    def to_dict(self) -> dict:
        out = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out


EMPTY = Descriptor.of(EMPTY_CONFIG, EMPTY_BLOB)


def build_manifest(artifact_type: str, layers: list[Descriptor]) -> bytes:
    """The canonical bytes of an entry's manifest: the same entry gives the same digest on
    every runner (two runners pushing one layer store one manifest)."""
    return canonical({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
                      "config": EMPTY.to_dict(), "layers": [layer.to_dict() for layer in layers]})


def _descriptor(value, what: str, limits: dict[str, int]) -> Descriptor:
    if not isinstance(value, dict):
        raise WireError(f"its {what} is not a descriptor")
    media, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    if media not in limits:
        raise WireError(f"its {what} has media type {str(media)[:80]!r}, expected one of {', '.join(limits)}")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise WireError(f"its {media} descriptor has no sha256 digest")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= limits[media]:
        raise WireError(f"its {media} descriptor claims {str(size)[:20]} bytes (at most {limits[media]})")
    annotations = value.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in annotations.items()):
        raise WireError(f"its {media} descriptor has malformed annotations")
    return Descriptor(media, digest, size, annotations)


def parse_manifest(data: bytes, artifact_type: str, limits: dict[str, int]) -> dict[str, Descriptor]:
    """The layers of an entry's manifest by media type; WireError unless the manifest is an OCI
    image manifest of `artifact_type` with the empty config and exactly one layer of each media
    type in `limits` (media type -> largest size accepted)."""
    if len(data) > MAX_MANIFEST:
        raise WireError(f"its manifest is {len(data)} bytes (at most {MAX_MANIFEST})")
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise WireError("its manifest is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2 or \
            manifest.get("mediaType") != OCI_MANIFEST:
        raise WireError("it is not an OCI image manifest")
    if manifest.get("artifactType") != artifact_type:
        raise WireError(f"it holds artifact type {str(manifest.get('artifactType'))[:80]!r}, not {artifact_type}")
    config = _descriptor(manifest.get("config"), "config", {EMPTY_CONFIG: len(EMPTY_BLOB)})
    if config.digest != EMPTY.digest:
        raise WireError("its config is not the OCI empty descriptor")
    layers = manifest.get("layers")
    if not isinstance(layers, list) or len(layers) != len(limits):
        raise WireError(f"it has {len(layers) if isinstance(layers, list) else 'no'} layers, expected {len(limits)}")
    found: dict[str, Descriptor] = {}
    for layer in layers:
        descriptor = _descriptor(layer, "layer", limits)
        if descriptor.media_type in found:
            raise WireError(f"it has two {descriptor.media_type} layers")
        found[descriptor.media_type] = descriptor
    return found


KERNEL_LIMITS = {WHEEL_MEDIA: MAX_WHEEL, KERNEL_META_MEDIA: MAX_META}
LAYER_LIMITS = {LAYER_MEDIA: MAX_LAYER, LAYER_META_MEDIA: MAX_META}
BASE_LIMITS = {BASE_MEDIA: MAX_LAYER, BASE_META_MEDIA: MAX_META}
RESOLUTION_LIMITS = {RESOLUTION_MEDIA: MAX_META}
