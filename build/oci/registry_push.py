"""Push an assembled image from its OCI layout through the registry API, blob by blob.

`docker push` would recompress the layers, so the pushed digest would be the engine's, not the
build's. Here the registry receives the exact blobs and manifest the build wrote, so the digest
in build-report.json is the one a deployment pins, from any machine that builds the same inputs.
The client has the shape build/push.py expects of dockerd's push: a stream of per-layer status
items, the digest in an `aux` item, errors as `error` items.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from build.oci.image import OCI_MANIFEST, read_layout
from build.registry import Registry, RegistryError


class LayoutRegistryClient:
    def __init__(self, layout: Path, registry: Registry, path: str):
        self.layout, self.registry, self.path = Path(layout), registry, path

    def tag(self, image: str, repository: str, tag: str) -> None:
        """Nothing to tag: the layout is pushed, not an engine's image."""

    def untag(self, reference: str) -> None:
        """Nothing was tagged."""

    def repo_digests(self, image: str) -> list[str]:
        return []

    def push(self, repository: str, tag: str) -> Iterator[dict[str, Any]]:
        try:
            manifest, config, layers = read_layout(self.layout)
            described = json.loads(manifest)["layers"]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            yield {"error": f"the OCI layout {self.layout} is unreadable ({exc}): build again"}
            return
        try:
            for blob, entry in zip(layers, described, strict=True):
                short = entry["digest"][7:19]
                yield {"status": "Pushing", "id": short}
                sent = self.registry.put_blob_file(self.path, blob, entry["digest"], entry["size"])
                yield {"status": "Pushed" if sent else "Layer already exists", "id": short}
            config_digest = json.loads(manifest)["config"]["digest"]
            config_path = self.layout / "blobs" / "sha256" / config_digest.removeprefix("sha256:")
            self.registry.put_blob_file(self.path, config_path, config_digest, len(config))
            digest = self.registry.put_manifest(self.path, tag, manifest, OCI_MANIFEST)
        except RegistryError as exc:
            yield {"error": str(exc)}
            return
        yield {"aux": {"Tag": tag, "Digest": digest, "Size": len(manifest)}}
