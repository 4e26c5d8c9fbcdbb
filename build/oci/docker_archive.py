"""The docker-archive (what `docker load` reads), written deterministically: streamed to the
engine, or to a file.

One writer for both users. An assembled image goes to the engine streamed, never written out:
Docker 20.10 cannot load an OCI layout, but it loads a docker-archive whose layers are gzipped
blobs, and it reads a layer's file only when the engine lacks that layer's chain. So the
archive names every layer and carries only those past the longest prefix the engine already
holds: after a commit, that is the app layer, a few hundred kilobytes. Should the engine have
dropped a layer in between, the load fails and is retried with every layer. A bootstrapped
base (build/base/bootstrap.py) is one uncompressed layer written to a file and loaded from it.

Entries are in a fixed order with fixed metadata (mode, mtime 0, numeric owner 0), and the
config is the one the build wrote, so the image ID `docker load` gives is the config's sha256.
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from build.cache import sha256_file
from build.errors import BuildFailure

BLOCK = 512
CHUNK = 1 << 20


class ArchiveLayer(Protocol):
    """A layer as the archive needs it: its diffID, and the file that holds it (a CachedLayer)."""
    diff_id: str
    path: Path
    size: int


@dataclass(frozen=True)
class LayerFile:
    diff_id: str
    path: Path
    size: int


@dataclass(frozen=True)
class ArchiveImage:
    id: str            # sha256:<hex> of the config, the ID `docker load` gives the image
    diff_id: str       # sha256:<hex> of the uncompressed layer
    path: Path


def file_sha256(path: Path) -> str:
    """`sha256:<hex>` of a file: an uncompressed layer's diffID."""
    return "sha256:" + sha256_file(path)


def _member(name: str, size: int, directory: bool = False) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = (0 if directory else size), (0o755 if directory else 0o644), 0
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


def archive_chunks(config: bytes, tag: str, layers: Sequence[ArchiveLayer], skip: int = 0) -> Iterator[bytes]:
    """The docker-archive of the image, as chunks; the first `skip` layers are named, not sent."""
    image_hex = hashlib.sha256(config).hexdigest()
    names = [f"{layer.diff_id.removeprefix('sha256:')}/layer.tar" for layer in layers]
    manifest = json.dumps([{"Config": f"{image_hex}.json", "RepoTags": [tag], "Layers": names}],
                          separators=(",", ":")).encode()
    for layer, name in list(zip(layers, names, strict=True))[skip:]:
        yield _member(name.rpartition("/")[0], 0, directory=True)
        yield _member(name, layer.size)
        with layer.path.open("rb") as fh:
            while chunk := fh.read(CHUNK):
                yield chunk
        yield _padding(layer.size)
    for name, data in ((f"{image_hex}.json", config), ("manifest.json", manifest)):
        yield _member(name, len(data))
        yield data + _padding(len(data))
    yield b"\0" * (BLOCK * 2)


def write_archive(layer: Path, out: Path, *, ref: str, config: bytes, diff_id: str) -> ArchiveImage:
    """The archive of a single-layer image at `out`, naming `ref`: the same bytes
    `archive_chunks` streams, the layer copied through, never read into memory."""
    with out.open("wb") as fh:
        for chunk in archive_chunks(config, ref, [LayerFile(diff_id, layer, layer.stat().st_size)]):
            fh.write(chunk)
    return ArchiveImage(id="sha256:" + hashlib.sha256(config).hexdigest(), diff_id=diff_id, path=out)


def held_prefix(diff_ids: list[str], chains_held: Iterable[list[str]]) -> int:
    """How many leading layers of `diff_ids` the engine holds (as the start of some image's layers)."""
    best = 0
    for held in chains_held:
        n = 0
        while n < min(len(held), len(diff_ids)) and held[n] == diff_ids[n]:
            n += 1
        best = max(best, n)
    return best


def load(engine, config: bytes, tag: str, layers: Sequence[ArchiveLayer], image_id: str) -> tuple[str, int]:
    """Stream the image into the engine and check it kept the ID; returns (image ID, layers sent)."""
    chains = []
    for image in engine.images_with_label("io.ftimage.image"):
        info = engine.image(image["Id"]) or {}
        chains.append(list((info.get("RootFS") or {}).get("Layers") or []))
    skip = held_prefix([layer.diff_id for layer in layers], chains)
    try:
        loaded = engine.load_stream(archive_chunks(config, tag, layers, skip), tag)
    except BuildFailure:
        if skip == 0:
            raise
        skip = 0       # a layer went missing between the listing and the load: send them all
        loaded = engine.load_stream(archive_chunks(config, tag, layers, 0), tag)
    if loaded != image_id:
        raise BuildFailure(f"the engine gave the loaded image the ID {loaded[:19]}, not its config's {image_id[:19]}",
                           "check the dockerd log: the engine must keep the config as given")
    return loaded, len(layers) - skip


def read_archive(chunks: Iterable[bytes]) -> tarfile.TarFile:
    """The archive as a tar, in memory: for tests and the fake engine only (small layers)."""
    return tarfile.open(fileobj=io.BytesIO(b"".join(chunks)))
