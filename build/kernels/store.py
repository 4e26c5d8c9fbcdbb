"""The kernel wheel cache: one directory per content-addressed key, published atomically.

    kernels/<key>/meta.json     key, inputs, wheel sha256, archs, compiler, log digest, duration
    kernels/<key>/<wheel>.whl
    kernels/<key>/build.log

An entry is staged in `kernels/.tmp-<key>-*` and renamed into place only once the wheel has
passed every check, under a per-key file lock, so a concurrent or killed build never exposes
half an entry. A hit is only a hit if the wheel's sha256 still matches meta.json; an entry
that does not is reported by name (`--plan`, `kernels list`, the build log) and rebuilt,
never used and never deleted without a word. An entry of a Triton kernel built from its sdist
is also checked against what its key does not cover (its patches and knobs: `built_from`); one
made from others is stale, named and rebuilt.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from build.cache import CacheLayout, sha256_file
from build.errors import BuildFailure
from contracts import atomic

META = "meta.json"
KEY = re.compile(r"[0-9a-f]{64}")
WHEEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*\.whl")


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


@dataclass(frozen=True)
class EntryState:
    key: str
    state: str          # "hit", "miss", "corrupt" or "stale" (made from other unkeyed inputs)
    detail: str = ""
    entry: KernelEntry | None = None


def read_entry(directory: Path, key: str, built_from: dict[str, Any] | None = None) -> EntryState:
    """Inspect one entry directory without changing it. `built_from`: what the entry must have
    been made from beyond its key (compile.unkeyed_inputs), or None when the key covers it all."""
    meta_path = directory / META
    if not meta_path.is_file():
        return EntryState(key, "miss")
    try:
        meta = json.loads(meta_path.read_text())
        wheel_name = meta["wheel"]
        if not isinstance(wheel_name, str) or not WHEEL.fullmatch(wheel_name):
            return EntryState(key, "corrupt", f"meta.json names an invalid wheel {str(wheel_name)[:40]!r}")
        if meta.get("key") != key:
            return EntryState(key, "corrupt", "meta.json belongs to another key")
        wheel = directory / wheel_name
        if not wheel.is_file():
            return EntryState(key, "corrupt", f"{wheel_name} is missing")
        actual = sha256_file(wheel)
        if actual != meta["sha256"]:
            return EntryState(key, "corrupt", f"{wheel_name} has sha256 {actual[:12]}..., meta.json says "
                                              f"{str(meta['sha256'])[:12]}...")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return EntryState(key, "corrupt", f"meta.json is unreadable ({type(exc).__name__})")
    if built_from is not None and meta.get("built_from") != built_from:
        return EntryState(key, "stale", f"{wheel_name} was built from other patches, knobs or build requirements "
                                        "than the plan's (this kernel's key covers its sources only)")
    return EntryState(key, "hit", entry=KernelEntry(key=key, directory=directory, meta=meta))


class KernelStore:
    def __init__(self, cache: CacheLayout):
        self.root = cache.kernels   # created on first write, so `--plan` writes nothing

    def _dir(self, key: str) -> Path:
        if not KEY.fullmatch(key):
            raise ValueError(f"not a kernel key: {key!r}")
        return self.root / key

    def lock(self, key: str) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / f".{self._dir(key).name}.lock"))

    def state(self, key: str, built_from: dict[str, Any] | None = None) -> EntryState:
        return read_entry(self._dir(key), key, built_from)

    def get(self, key: str) -> KernelEntry | None:
        """A verified entry, or None (a corrupt entry is not used; `state` says why)."""
        return self.state(key).entry

    def states(self) -> list[EntryState]:
        if not self.root.is_dir():
            return []
        return [read_entry(d, d.name) for d in sorted(self.root.iterdir()) if d.is_dir() and KEY.fullmatch(d.name)]

    def entries(self) -> list[KernelEntry]:
        return [s.entry for s in self.states() if s.entry]

    def staging(self, key: str) -> Path:
        """A fresh staging dir. The caller holds this key's lock, so an older staging dir of the
        same key is a killed build's leftover; other keys' dirs may belong to live builds."""
        for leftover in self.root.glob(f".tmp-{key[:16]}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return atomic.staging_dir(self.root, key[:16])

    def publish(self, key: str, staging: Path, meta: dict[str, Any]) -> KernelEntry:
        """Rename a checked staging dir into place; a corrupt entry of the same key is replaced."""
        wheel = staging / meta["wheel"]
        if sha256_file(wheel) != meta["sha256"]:
            raise BuildFailure(f"staged wheel {wheel.name} changed before publishing", "re-run the build")
        atomic.write_json(staging / META, {**meta, "key": key}, sort_keys=True)
        replace = self.state(key).state == "corrupt"
        atomic.publish_dir(staging, self._dir(key), replace=replace)
        entry = self.get(key)
        if entry is None:
            raise BuildFailure(f"kernel cache entry {key[:16]} failed verification right after publishing",
                               f"check the disk under {self.root}")
        return entry

    def evict(self, key: str) -> bool:
        """Remove an entry (the caller holds `lock(key)`): renamed out of its key's place first, so
        no reader ever sees half of it, then deleted. False when there was none."""
        directory = self._dir(key)
        if not directory.exists():
            return False
        aside = directory.with_name(f"{atomic.TMP_PREFIX}evicted-{key}-{os.getpid()}")
        os.rename(directory, aside)
        shutil.rmtree(aside, ignore_errors=True)
        return True

    def recorded_duration(self, name: str) -> float | None:
        """The most recent compile time recorded for any entry of this kernel (for plan estimates)."""
        durations = [(e.meta.get("created", 0), e.meta.get("duration_s")) for e in self.entries()
                     if e.meta.get("inputs", {}).get("kernel") == name and e.meta.get("duration_s")]
        return max(durations)[1] if durations else None

    # -- portability: see build/kernels/portable.py ---------------------------------
