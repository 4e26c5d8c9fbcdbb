"""The kernel wheel cache: one directory per content-addressed key, published atomically.

    kernels/<key>/meta.json     key, inputs, wheel sha256, archs, compiler, log digest, duration
    kernels/<key>/<wheel>.whl
    kernels/<key>/build.log

An entry is staged in `kernels/.tmp-<key>-*` and renamed into place only once the wheel
has passed every check, under a per-key file lock, so a concurrent or killed build never
exposes half an entry. A hit is only a hit if the wheel's sha256 still matches meta.json.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from build.cache import CacheLayout, atomic_publish_dir, sha256_file
from build.errors import BuildFailure

META = "meta.json"


@dataclass(frozen=True)
class KernelEntry:
    key: str
    directory: Path
    meta: dict[str, Any]

    @property
    def wheel(self) -> Path:
        return self.directory / self.meta["wheel"]

    @property
    def sha256(self) -> str:
        return self.meta["sha256"]


class KernelStore:
    def __init__(self, cache: CacheLayout):
        self.root = cache.kernels
        self.root.mkdir(parents=True, exist_ok=True)

    def lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / f".{key}.lock"))

    def get(self, key: str) -> KernelEntry | None:
        """A verified entry, or None. A corrupt entry is evicted so the next build recompiles."""
        directory = self.root / key
        meta_path = directory / META
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            wheel = directory / meta["wheel"]
            ok = meta.get("key") == key and wheel.is_file() and sha256_file(wheel) == meta["sha256"]
        except (OSError, ValueError, KeyError):
            ok = False
        if not ok:
            shutil.rmtree(directory, ignore_errors=True)
            return None
        return KernelEntry(key=key, directory=directory, meta=meta)

    def entries(self) -> list[KernelEntry]:
        return [e for d in sorted(self.root.iterdir()) if d.is_dir() and not d.name.startswith(".")
                if (e := self.get(d.name))]

    def staging(self, key: str) -> Path:
        """A fresh staging dir. The caller holds this key's lock, so an older staging dir of the
        same key is a killed build's leftover; other keys' dirs may belong to live builds."""
        for leftover in self.root.glob(f".tmp-{key[:16]}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=self.root))
        staging.chmod(0o755)  # mkdtemp's 0700 would make a shared cache unreadable to other users
        return staging

    def publish(self, key: str, staging: Path, meta: dict[str, Any]) -> KernelEntry:
        wheel = staging / meta["wheel"]
        if sha256_file(wheel) != meta["sha256"]:
            raise BuildFailure(f"staged wheel {wheel.name} changed before publishing", "re-run the build")
        (staging / META).write_text(json.dumps({**meta, "key": key}, indent=2, sort_keys=True) + "\n")
        atomic_publish_dir(staging, self.root / key)
        entry = self.get(key)
        if entry is None:
            raise BuildFailure(f"kernel cache entry {key[:16]} failed verification right after publishing",
                               f"check the disk under {self.root}")
        return entry

    def recorded_duration(self, name: str) -> float | None:
        """The most recent compile time recorded for any entry of this kernel (for plan estimates)."""
        durations = [(e.meta.get("created", 0), e.meta.get("duration_s")) for e in self.entries()
                     if e.meta.get("inputs", {}).get("kernel") == name and e.meta.get("duration_s")]
        return max(durations)[1] if durations else None

    # -- portability ----------------------------------------------------------------

    def export(self, destination: Path) -> list[str]:
        destination.mkdir(parents=True, exist_ok=True)
        exported = []
        for entry in self.entries():
            target = destination / entry.key
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(entry.directory, target)
            exported.append(entry.key)
        return exported

    def import_from(self, source: Path) -> tuple[list[str], list[str]]:
        """Import every entry in `source`, verifying each wheel's hash. Returns (imported, rejected)."""
        if not source.is_dir():
            raise BuildFailure(f"{source} is not a directory", "pass the directory written by `kernels export`")
        imported, rejected = [], []
        for directory in sorted(p for p in source.iterdir() if p.is_dir()):
            key = directory.name
            try:
                meta = json.loads((directory / META).read_text())
                wheel = directory / meta["wheel"]
                valid = meta.get("key") == key and wheel.is_file() and sha256_file(wheel) == meta["sha256"]
            except (OSError, ValueError, KeyError):
                valid = False
            if not valid:
                rejected.append(key)
                continue
            with self.lock(key):
                if self.get(key):
                    imported.append(key)
                    continue
                staging = self.staging(key)
                for item in directory.iterdir():
                    if item.is_file():
                        shutil.copyfile(item, staging / item.name)
                (staging / META).unlink(missing_ok=True)
                self.publish(key, staging, meta)
                imported.append(key)
        return imported, rejected
