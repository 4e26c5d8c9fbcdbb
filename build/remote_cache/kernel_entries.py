"""A compiled kernel's cache entry (KernelStore's `kernels/<key>/`) as a remote artifact, and back.

Pushed: the wheel (annotated with its file name) and meta.json, as the two layers of a
`kernel-<key>` manifest. Fetched: meta.json first (small, bounded), which must name the key
asked for and the wheel blob's digest, and pass the checks that need no wheel against the key's
own inputs from the plan (build/kernels/acceptance.py: inputs, archs, wheel name and tags, the
torch and CUDA it recorded; `--plan` stops here); then the wheel, streamed into a KernelStore
staging folder and re-hashed; then the staged entry must prove itself as an imported export does
(build/kernels/portable.py `prove_entry`, with the plan's inputs: the checks above again, and
the wheel's own SASS and PTX per arch and its dist-info) before KernelStore.publish renames it
into place. An entry that fails is never in the local cache: the staging folder is removed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from build.kernels.acceptance import Expected, meta_problems, refusal
from build.kernels.portable import prove_entry
from build.kernels.store import META, WHEEL, KernelEntry, KernelStore
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.wire import (
    KERNEL_ARTIFACT,
    KERNEL_META_MEDIA,
    MAX_META,
    TITLE,
    WHEEL_MEDIA,
    Descriptor,
    WireError,
    build_manifest,
)

Blob = tuple[Descriptor, Path | bytes]     # what to upload: from a file (streamed) or bytes


def kernel_manifest(entry: KernelEntry) -> tuple[bytes, list[Blob]]:
    meta = (entry.directory / META).read_bytes()
    wheel = entry.wheel
    layers: list[Blob] = [
        (Descriptor(WHEEL_MEDIA, "sha256:" + entry.sha256, wheel.stat().st_size, {TITLE: wheel.name}), wheel),
        (Descriptor.of(KERNEL_META_MEDIA, meta), meta)]
    return build_manifest(KERNEL_ARTIFACT, [d for d, _ in layers]), layers


def read_meta(client: CacheRegistry, path: str, expected: Expected,
              layers: dict[str, Descriptor]) -> tuple[dict, bytes]:
    """meta.json of an entry (and its bytes) once it passed every check that needs no wheel
    download; WireError says what it gets wrong."""
    key = expected.key
    wheel_blob, meta_blob = layers[WHEEL_MEDIA], layers[KERNEL_META_MEDIA]
    raw = client.small_blob(path, meta_blob.digest, MAX_META)
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise WireError("its meta.json is not JSON") from None
    if not isinstance(meta, dict):
        raise WireError("its meta.json is not a JSON object")
    if meta.get("key") != key:
        raise WireError(f"its meta.json names another key ({str(meta.get('key'))[:16]}...), not {key[:16]}...")
    wheel = meta.get("wheel")
    if not isinstance(wheel, str) or not WHEEL.fullmatch(wheel):
        raise WireError(f"its meta.json names an invalid wheel {str(wheel)[:40]!r}")
    if wheel_blob.annotations.get(TITLE) != wheel:
        raise WireError(f"its wheel layer is titled {wheel_blob.annotations.get(TITLE, '')[:60]!r}, meta.json "
                        f"names {wheel}")
    if wheel_blob.digest != f"sha256:{meta.get('sha256')}":
        raise WireError(f"its wheel blob {wheel_blob.digest[:19]} is not the wheel meta.json's sha256 names "
                        f"({str(meta.get('sha256'))[:12]}...)")
    problems = meta_problems(meta, expected)
    if problems:
        raise WireError(f"its meta.json is not this key's: {refusal(problems)}")
    return meta, raw


def fetch_kernel(client: CacheRegistry, path: str, expected: Expected, layers: dict[str, Descriptor],
                 store: KernelStore, provenance: dict[str, str]) -> KernelEntry:
    """Download, re-hash, check against `expected` and publish one entry; the caller holds
    `store.lock(expected.key)`. ValueError (WireError) says what the entry gets wrong; nothing is
    left in the store then."""
    key = expected.key
    meta, raw = read_meta(client, path, expected, layers)
    wheel_blob = layers[WHEEL_MEDIA]
    staging = store.staging(key)
    try:
        client.download(path, wheel_blob.digest, wheel_blob.size, staging / meta["wheel"])
        (staging / META).write_bytes(raw)
        prove_entry(staging, key, expected)
        return store.publish(key, staging, {**meta, **provenance})
    finally:
        shutil.rmtree(staging, ignore_errors=True)   # gone already once published
