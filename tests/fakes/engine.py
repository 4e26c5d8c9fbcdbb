"""A fake container engine for unit tests of the pipeline and kernel-stage logic: it keeps
images in a dict, records every call, and runs "containers" through a handler the test gives."""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from build.engine import BuiltImage, RunResult
from build.errors import BuildFailure
from contracts.events import EventLog


@dataclass
class FakeEngine:
    images: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    on_run: Callable[..., RunResult] | None = None
    removed_containers: int = 0
    free_bytes: int | None = None     # None: the engine's disk is not on this host (not checked)
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)   # (image, path) -> what read_file gives

    def image(self, ref: str) -> dict[str, Any] | None:
        self.calls.append(("image", ref))
        return self.images.get(ref)

    def tag(self, image_id: str, ref: str) -> None:
        self.calls.append(("tag", ref))
        found = next(i for i in self.images.values() if i["Id"] == image_id)
        self.images[ref] = found

    def remove(self, ref: str) -> bool:
        self.calls.append(("remove", ref))
        if ref in self.images:
            del self.images[ref]
            return True
        by_id = [k for k, i in self.images.items() if i["Id"] == ref]
        for key in by_id:
            del self.images[key]
        return bool(by_id)

    def load_archive(self, archive: Path, ref: str) -> str:
        import json
        import tarfile

        self.calls.append(("load", ref))
        with tarfile.open(archive) as tar:
            manifest = json.load(tar.extractfile("manifest.json"))[0]
            config = json.load(tar.extractfile(manifest["Config"]))
        image_id = "sha256:" + manifest["Config"].removesuffix(".json")
        self.images[ref] = {"Id": image_id, "Size": 1, "Config": {"Labels": config["config"]["Labels"]},
                            "RepoTags": [ref]}
        return image_id

    def load_stream(self, chunks, ref: str) -> str:
        """Like `docker load`: layers named but not sent must be ones an image here already has."""
        import json

        from build.oci.docker_archive import read_archive

        self.calls.append(("load_stream", ref))
        with read_archive(chunks) as tar:
            manifest = json.load(tar.extractfile("manifest.json"))[0]
            config = json.load(tar.extractfile(manifest["Config"]))
            sent = set(tar.getnames())
        diff_ids = config["rootfs"]["diff_ids"]
        held = [list(i.get("RootFS", {}).get("Layers", [])) for i in self.images.values()]
        for n, name in enumerate(manifest["Layers"]):
            if name not in sent and not any(h[:n + 1] == diff_ids[:n + 1] for h in held):
                raise BuildFailure(f"docker load of {ref} failed: open {name}: no such file or directory", "")
        image_id = "sha256:" + manifest["Config"].removesuffix(".json")
        self.images[ref] = {"Id": image_id, "Size": 1, "Config": {"Labels": config["config"]["Labels"]},
                            "RepoTags": [ref], "RootFS": {"Layers": diff_ids}, "Created": len(self.calls)}
        self.images[image_id] = self.images[ref]
        self.layers_sent = getattr(self, "layers_sent", []) + [len([n for n in manifest["Layers"] if n in sent])]
        return image_id

    def save(self, ref: str, dest: Path) -> None:
        raise AssertionError(f"unexpected docker save of {ref}")

    def history(self, ref: str) -> list[dict[str, Any]]:
        return []

    def build(self, context: Path, tag: str, labels: dict[str, str], log: EventLog, *,
              expected_steps_seconds: float | None = None) -> BuiltImage:
        self.calls.append(("build", tag))
        digest = hashlib.sha256((tag + repr(sorted(labels.items()))).encode()).hexdigest()
        self.images[tag] = {"Id": f"sha256:{digest}", "Size": 1024, "Config": {"Labels": dict(labels)},
                            "RepoTags": [tag], "Created": len(self.calls)}
        return BuiltImage(id=f"sha256:{digest}", tag=tag, size_bytes=1024, step_seconds=())

    def run(self, image: str, command: list[str] | None = None, **kwargs) -> RunResult:
        self.calls.append(("run", image))
        if self.on_run is None:
            raise AssertionError(f"unexpected container run of {image}")
        return self.on_run(image, command, **kwargs)

    def remove_containers(self, label: str) -> int:
        self.calls.append(("remove_containers", label))
        return 0

    def read_file(self, image: str, path: str, *, limit: int) -> bytes | None:
        self.calls.append(("read_file", (image, path)))
        data = self.files.get((image, path))
        return data if data is not None and len(data) <= limit else None

    def images_with_label(self, label: str) -> list[dict[str, Any]]:
        key, _, value = label.partition("=")
        found = {i["Id"]: {**i, "Labels": i["Config"]["Labels"]} for i in self.images.values()
                 if key in i["Config"]["Labels"] and (not value or i["Config"]["Labels"][key] == value)}
        # like the engine's image list: labels at the top level, newest first
        return sorted(found.values(), key=lambda i: i.get("Created", 0), reverse=True)

    def disk_space(self) -> tuple[str, int] | None:
        return None if self.free_bytes is None else ("/var/lib/docker", self.free_bytes)

    def count(self, kind: str) -> int:
        return sum(1 for c in self.calls if c[0] == kind)
