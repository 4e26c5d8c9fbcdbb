"""An image's pip resolution as a remote artifact, and back: so a fresh runner whose layers are
all in the registry downloads no wheel.

The entry (`resolution-<key>`, the key the local resolution cache uses: the requirements, the
pinned torch wheel, the Python and the platform) holds one layer, resolution.json: the local
cache's record of the closure (each wheel's name, version, file name, sha256 and size, and the
record's own sha256) plus `wheels_epoch`, the newest entry time inside those wheels. That time
is what the venv layer's key, the lock layer's time and the SBOM's carry, and it is read from
the wheels' files themselves; the entry carries it so that a runner without the files still
makes the same layers, lock and image ID.

resolution.json is checked as the local record is (schema, its own sha256, every file name and
sha256, the toolchain's pinned torch wheel among the wheels) and its key must be the one asked for.
"""
from __future__ import annotations

import json

from build.kernels import pinned_wheels
from build.oci.image import canonical
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.wire import (
    MAX_META,
    RESOLUTION_ARTIFACT,
    RESOLUTION_MEDIA,
    Descriptor,
    WireError,
    build_manifest,
)
from build.resolve import BuildPlan, digest
from build.wheelhouse import Wheel, parse_resolution, resolution_key, resolution_record

MAX_EPOCH = 1 << 33       # a zip entry's time is before the year 2242


def resolution_entry_key(plan: BuildPlan) -> str:
    """The entry's key: the pip closure's (as the local resolution cache keys it) and the sha256
    of every kernel wheel the plan pins (a Triton kernel's), whose entry times `wheels_epoch`
    covers too, so a runner need not download those either."""
    return digest({"resolution": resolution_key(plan.python_requirements, plan),
                   "pinned_kernel_wheels": sorted(source.sha256 for source in pinned_wheels(plan))})


def resolution_bytes(key: str, wheels: tuple[Wheel, ...], epoch: int) -> bytes:
    return canonical({**resolution_record(wheels), "key": key, "wheels_epoch": epoch})


def resolution_manifest(key: str, wheels: tuple[Wheel, ...], epoch: int) -> tuple[bytes, list]:
    raw = resolution_bytes(key, wheels, epoch)
    blobs = [(Descriptor.of(RESOLUTION_MEDIA, raw), raw)]
    return build_manifest(RESOLUTION_ARTIFACT, [d for d, _ in blobs]), blobs


def read_resolution(client: CacheRegistry, path: str, key: str, plan: BuildPlan,
                    layers: dict[str, Descriptor]) -> tuple[tuple[Wheel, ...], int]:
    """(the closure, its wheels' newest entry time); WireError says what the entry gets wrong."""
    raw = client.small_blob(path, layers[RESOLUTION_MEDIA].digest, MAX_META)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise WireError("its resolution.json is not JSON") from None
    named = data.get("key") if isinstance(data, dict) else None
    if named != key:
        raise WireError(f"its resolution.json is the closure of key {str(named)[:16]!r}, not {key[:16]}")
    epoch = data.get("wheels_epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < MAX_EPOCH:
        raise WireError("its resolution.json's wheels_epoch is not a time")
    wheels, problem = parse_resolution(data, plan)
    if wheels is None:
        raise WireError(f"its resolution.json is not a usable closure: {problem}")
    return wheels, epoch
