"""Write a single-layer image as a docker-archive (what `docker load` reads), deterministically.

`docker import` stamps the image with the time of the import, so importing the same root
filesystem twice gives two image IDs. Here the image config is written by this tool: its
`created` time is SOURCE_DATE_EPOCH, it has no host name, no container ID and no parent, and
its JSON is canonical, so the image ID (the sha256 of the config) is a function of the layer's
content and the declared settings alone.
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20


@dataclass(frozen=True)
class ArchiveImage:
    id: str            # sha256:<hex> of the config, the ID `docker load` gives the image
    diff_id: str       # sha256:<hex> of the uncompressed layer
    path: Path


def rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def image_config(diff_id: str, *, epoch: int, env: list[str], cmd: list[str], labels: dict[str, str],
                 created_by: str, architecture: str = "amd64") -> bytes:
    when = rfc3339(epoch)
    return json.dumps({"architecture": architecture, "os": "linux", "created": when,
                       "config": {"Env": env, "Cmd": cmd, "Labels": dict(sorted(labels.items()))},
                       "rootfs": {"type": "layers", "diff_ids": [diff_id]},
                       "history": [{"created": when, "created_by": created_by}]},
                      sort_keys=True, separators=(",", ":")).encode()


def write_archive(layer: Path, out: Path, *, ref: str, config: bytes, diff_id: str) -> ArchiveImage:
    """The archive at `out`: the layer (streamed, never read into memory), the config and
    manifest.json naming `ref`. Entries are in a fixed order with fixed metadata."""
    image_hex = hashlib.sha256(config).hexdigest()
    layer_name = f"{diff_id.removeprefix('sha256:')}/layer.tar"
    manifest = json.dumps([{"Config": f"{image_hex}.json", "RepoTags": [ref], "Layers": [layer_name]}],
                          separators=(",", ":")).encode()

    def info(name: str, size: int) -> tarfile.TarInfo:
        entry = tarfile.TarInfo(name)
        entry.size, entry.mode, entry.mtime, entry.uid, entry.gid = size, 0o644, 0, 0, 0
        return entry

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as archive:
        folder = info(layer_name.rpartition("/")[0], 0)
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        archive.addfile(folder)
        with layer.open("rb") as fh:
            archive.addfile(info(layer_name, layer.stat().st_size), fh)
        archive.addfile(info(f"{image_hex}.json", len(config)), io.BytesIO(config))
        archive.addfile(info("manifest.json", len(manifest)), io.BytesIO(manifest))
    return ArchiveImage(id=f"sha256:{image_hex}", diff_id=diff_id, path=out)
