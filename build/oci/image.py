"""The image from its layers: canonical config and manifest, and the OCI layout they are
written to.

The config holds no host, no container and no build-time clock: `created` and each history
entry carry the times of the layers' own inputs, and the JSON is canonical (sorted keys, no
spaces). So the image ID (the config's sha256) and the manifest digest are functions of the
layers and the declared settings alone. The one canonical JSON encoding (`canonical`) and
digest (`sha256_digest`) of every document this tool writes live here; so does the config of a
bootstrapped base, a single-layer image (`image_config`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from build.cache import link_or_copy
from build.oci.layercache import CachedLayer, LayerCache, layer_key
from build.oci.tarlayer import DIR_MODE, EXEC_MODE, FILE_MODE, TreeEntry, parents, tree_entries, write_layer

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
LAYOUT_DIR = "oci"


def canonical(document) -> bytes:
    """The one JSON encoding of a document this tool writes (sorted keys, no spaces)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class RuntimeSettings:
    user: str                   # "uid:gid"
    env: list[str]
    entrypoint: list[str]
    cmd: list[str]
    workdir: str
    labels: dict[str, str]


@dataclass
class AssembledImage:
    config: bytes
    manifest: bytes
    layers: list[CachedLayer]
    created: int

    @property
    def image_id(self) -> str:
        return sha256_digest(self.config)

    @property
    def manifest_digest(self) -> str:
        return sha256_digest(self.manifest)

    @property
    def diff_ids(self) -> list[str]:
        return [layer.diff_id for layer in self.layers]

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)

    layer_states: dict[str, str] = field(default_factory=dict)


def file_layer(cache: LayerCache, name: str, files: dict[str, tuple[bytes, int]], mtime: int,
               created_by: str) -> CachedLayer:
    """A small layer of files given as {image path: (bytes, mode)}, with their parent folders."""
    folders: dict[str, TreeEntry] = {}
    for path in files:
        for entry in parents(path):
            folders.setdefault(entry.path, entry)
    entries = sorted(folders.values(), key=lambda e: e.path.split("/"))
    entries += [TreeEntry(path, "file", mode, data=data) for path, (data, mode) in sorted(files.items())]
    key = layer_key(name, {"files": {p: [hashlib.sha256(d).hexdigest(), m] for p, (d, m) in files.items()},
                           "mtime": mtime})
    return cache.get_or_make(key, name, created_by, mtime, lambda path: write_layer(path, entries, mtime))


def tree_layer(cache: LayerCache, name: str, root: Path, prefix: str, mtime: int, created_by: str,
               extra: dict[str, tuple[bytes, int]]) -> CachedLayer:
    """The staged folder `root` at `prefix`, plus `extra` files; keyed by every file's bytes."""
    key, ordered = tree_layer_key(name, root, prefix, mtime, extra)
    return cache.get_or_make(key, name, created_by, mtime, lambda path: write_layer(path, ordered, mtime))


def tree_layer_key(name: str, root: Path, prefix: str, mtime: int,
                   extra: dict[str, tuple[bytes, int]]) -> tuple[str, list[TreeEntry]]:
    """tree_layer's key, and its entries in layer order (the key alone is what `--plan` needs)."""
    entries = [*parents(prefix), *tree_entries(root, prefix)]
    files = {e.path: e for e in entries}
    for path, (data, mode) in extra.items():
        for folder in parents(path):
            files.setdefault(folder.path, folder)
        files[path] = TreeEntry(path, "file", mode, data=data)
    ordered = sorted(files.values(), key=lambda e: e.path.split("/"))
    fingerprint = [[e.path, e.kind, e.mode, e.target,
                    hashlib.sha256(e.data if e.data is not None else e.source.read_bytes()).hexdigest()
                    if e.kind == "file" else ""] for e in ordered]
    return layer_key(name, {"entries": fingerprint, "mtime": mtime}), ordered


def assemble(layers: list[CachedLayer], settings: RuntimeSettings, created: int) -> AssembledImage:
    history = [{"created": rfc3339(layer.mtime), "created_by": layer.created_by} for layer in layers]
    config = canonical({
        "architecture": "amd64", "os": "linux", "created": rfc3339(created),
        "config": {"User": settings.user, "Env": settings.env, "Entrypoint": settings.entrypoint,
                   "Cmd": settings.cmd, "WorkingDir": settings.workdir,
                   "Labels": dict(sorted(settings.labels.items()))},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": history})
    manifest = canonical({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": sha256_digest(config), "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER, "digest": layer.digest, "size": layer.size} for layer in layers]})
    return AssembledImage(config=config, manifest=manifest, layers=layers, created=created)


def image_config(diff_id: str, *, epoch: int, env: list[str], cmd: list[str], labels: dict[str, str],
                 created_by: str, architecture: str = "amd64") -> bytes:
    """The config of a single-layer image (a bootstrapped base): its time is `epoch`, never now."""
    when = rfc3339(epoch)
    return canonical({"architecture": architecture, "os": "linux", "created": when,
                      "config": {"Env": env, "Cmd": cmd, "Labels": dict(sorted(labels.items()))},
                      "rootfs": {"type": "layers", "diff_ids": [diff_id]},
                      "history": [{"created": when, "created_by": created_by}]})


def write_layout(image: AssembledImage, out_dir: Path, ref_name: str) -> Path:
    """An OCI image layout at out_dir/oci (blobs hard-linked from the layer cache), replaced whole."""
    final = out_dir / LAYOUT_DIR
    staging = out_dir / f".tmp-{LAYOUT_DIR}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    blobs = staging / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    try:
        for layer in image.layers:
            link_or_copy(layer.path, blobs / layer.digest.removeprefix("sha256:"))
        for data in (image.config, image.manifest):
            (blobs / sha256_digest(data).removeprefix("sha256:")).write_bytes(data)
        (staging / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))
        (staging / "index.json").write_bytes(canonical({
            "schemaVersion": 2, "mediaType": OCI_INDEX,
            "manifests": [{"mediaType": OCI_MANIFEST, "digest": image.manifest_digest, "size": len(image.manifest),
                           "annotations": {"org.opencontainers.image.ref.name": ref_name}}]}))
        old = out_dir / f".tmp-{LAYOUT_DIR}-old-{os.getpid()}"
        if final.exists():
            final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def read_layout(layout: Path) -> tuple[bytes, bytes, list[Path]]:
    """(manifest, config, layer blob paths) of the single image in an OCI layout this tool wrote."""
    index = json.loads((layout / "index.json").read_text())
    manifest_digest = index["manifests"][0]["digest"]
    blob = lambda digest: layout / "blobs" / "sha256" / digest.removeprefix("sha256:")  # noqa: E731
    manifest = blob(manifest_digest).read_bytes()
    parsed = json.loads(manifest)
    config = blob(parsed["config"]["digest"]).read_bytes()
    return manifest, config, [blob(layer["digest"]) for layer in parsed["layers"]]


__all__ = ["DIR_MODE", "EXEC_MODE", "FILE_MODE", "AssembledImage", "RuntimeSettings", "assemble", "canonical",
           "file_layer", "image_config", "read_layout", "rfc3339", "sha256_digest", "tree_layer", "write_layout"]
