"""Layers cached by the digest of their inputs, so a rebuild makes only the layers whose inputs
changed (after a commit: the app layer alone).

An entry is a folder `layers/<key>/` holding `layer.tar.gz` and `layer.json` (diffID, digest,
size, what it is). It is written in a scratch folder beside it and renamed into place, so a
killed build leaves no half-written entry; an entry whose files do not agree with its
`layer.json` is treated as missing and rebuilt. A hit is re-hashed against the digest it was
published with before it is used (`lookup`): a blob edited in place, even at the same size, is
removed and rebuilt (and named in `damaged`), never handed to the engine or a registry.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from build.cache import _alive
from build.errors import BuildFailure
from build.oci.tarlayer import GZIP_LEVEL, LayerBlob
from contracts import atomic

# Bump when the way layers are written changes, so old entries are not reused. 2: gzip in
# independent 1 MiB pieces (blockgzip), so a layer's blob bytes differ from format 1's.
LAYER_FORMAT = 2
BLOB_NAME, META_NAME = "layer.tar.gz", "layer.json"


@dataclass(frozen=True)
class CachedLayer:
    key: str
    name: str            # base, venv, lock, app
    diff_id: str
    digest: str
    size: int
    created_by: str      # the image history's line for this layer
    mtime: int
    path: Path
    reused: bool = False
    source: str = "local"    # where a reused layer came from: "local", or "registry" (the remote cache)

    def meta(self) -> dict:
        data = asdict(self)
        for transient in ("path", "reused", "key", "source"):
            data.pop(transient)
        return data


def layer_key(name: str, inputs: dict) -> str:
    document = {"format": LAYER_FORMAT, "gzip": GZIP_LEVEL, "layer": name, "inputs": inputs}
    return hashlib.sha256(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


# (cache, key, expected): `expected` is the name, created_by and mtime this build gives that
# key's layer, which a fetched entry's must equal (or None: no expectation)
RemoteFetch = Callable[["LayerCache", str, "dict | None"], "CachedLayer | None"]


class RefusedLayers(BuildFailure):
    """Fetched layers whose check, run while the image was loaded, failed: removed, never published."""

    def __init__(self, refused: dict[str, str]):
        super().__init__("fetched layer(s) failed their check: " +
                         "; ".join(f"{key[:12]}: {why}" for key, why in refused.items()),
                         "build again: they are assembled here this time")
        self.refused = refused


class LayerCache:
    def __init__(self, root: Path, remote: RemoteFetch | None = None):
        """`remote`: asked for a key the local cache lacks (the remote cache, build/remote_cache/);
        it publishes what it fetched through `staging` and `publish` (or `defer`) and returns it, or None."""
        self.root = root
        self.remote = remote
        self.damaged: list[str] = []    # keys whose blob no longer matched its digest (removed, rebuilt)
        self._checks: dict[str, tuple[Future, Path, CachedLayer]] = {}
        self._checker: ThreadPoolExecutor | None = None

    def lookup(self, key: str, *, check_content: bool = True) -> CachedLayer | None:
        """The cached layer for `key`, or None. A hit is trusted by its content, not its size: its
        blob is re-hashed against the digest it was published with (a blob edited in place would
        otherwise be loaded, and refused by every registry as DIGEST_INVALID); a damaged entry is
        removed so the caller rebuilds it."""
        folder = self.root / key
        try:
            meta = json.loads((folder / META_NAME).read_text())
            blob = folder / BLOB_NAME
            if blob.stat().st_size != meta["size"]:
                return None
            layer = CachedLayer(key=key, path=blob, reused=True, **meta)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if check_content and _sha256(blob) != layer.digest:
            self.damaged.append(key)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return layer

    def find(self, key: str, expected: dict | None = None) -> CachedLayer | None:
        """The layer for `key` from this cache, else from the remote cache (if any), else None.
        `expected`: {"name", "created_by", "mtime"} this build gives the layer; a remote entry
        that says otherwise is not used."""
        found = self.lookup(key)
        if found is None and self.remote is not None:
            found = self.remote(self, key, expected)
        return found

    def get_or_make(self, key: str, name: str, created_by: str, mtime: int,
                    make: Callable[[Path], LayerBlob]) -> CachedLayer:
        """The cached layer for `key`, or `make(path)` writes it at `path` and it is published."""
        found = self.find(key, {"name": name, "created_by": created_by, "mtime": mtime})
        if found is not None:
            return found
        staging = self.staging()
        try:
            blob = make(staging / BLOB_NAME)
            layer = CachedLayer(key=key, name=name, diff_id=blob.diff_id, digest=blob.digest, size=blob.size,
                                created_by=created_by, mtime=mtime, path=self.root / key / BLOB_NAME)
            published = self.publish(key, staging, layer)
            return replace(published, reused=False) if published is not None else layer
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @contextmanager
    def assembling(self):
        """Held while a build looks up, makes and records its layers: an entry made by one build
        but not yet recorded as used must not be pruned by another build's prune_unused."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".assembling.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            yield

    def staging(self) -> Path:
        """A scratch folder beside the entries, named for this process (sweep removes it if the
        process dies); the caller writes BLOB_NAME into it and removes it if it is not published."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-layer-{os.getpid()}-", dir=self.root))

    def publish(self, key: str, staging: Path, layer: CachedLayer) -> CachedLayer | None:
        """Write `layer`'s layer.json beside its blob in `staging` and rename the folder into
        place, whole; an entry a concurrent build published first is kept."""
        (staging / META_NAME).write_text(json.dumps(layer.meta(), sort_keys=True, indent=1) + "\n")
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, self.root / key)
        except OSError:
            if self.lookup(key, check_content=False) is None:   # not a concurrent build that published it
                raise
        return self.lookup(key, check_content=False)

    def defer(self, key: str, staging: Path, layer: CachedLayer, check: Callable[[Path], None]) -> CachedLayer:
        """A fetched layer whose last check (the diffID: a gunzip of gigabytes) runs in the
        background while the build goes on and the engine loads the image from `staging`: the
        layer is published by `settle`, only once `check(blob)` returned, exactly as `publish`
        would have. Until then the returned layer's path is the staging copy."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-check")
        self._checks[key] = (self._checker.submit(check, staging / BLOB_NAME), staging, layer)
        return replace(layer, path=staging / BLOB_NAME)

    def settle(self) -> dict[str, str]:
        """Wait for every deferred check: publish what passed, remove what failed; returns the
        failed keys with why (ValueError/OSError of their check)."""
        checks, self._checks = self._checks, {}
        refused: dict[str, str] = {}
        for key, (check, staging, layer) in checks.items():
            try:
                check.result()
                self.publish(key, staging, layer)
            except (ValueError, OSError) as exc:
                refused[key] = str(exc)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return refused

    def record_use(self, image: str, keys: list[str]) -> None:
        """Remember which entries the newest build of `image` uses (see prune_unused)."""
        atomic.write_text(self.root / "used-by" / f"{image}.json", json.dumps(sorted(keys)) + "\n")

    def prune_unused(self) -> list[str]:
        """Remove entries that no image's newest build uses: what a build superseded (an old app
        layer, the venv of a changed wheel set) would otherwise fill the disk, gigabytes a time."""
        if not self.root.is_dir():
            return []
        with open(self.root / ".assembling.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return []     # another build is assembling: its new entries are not recorded yet
            return self._prune_unused_locked()

    def _prune_unused_locked(self) -> list[str]:
        used: set[str] = set()
        for record in sorted((self.root / "used-by").glob("*.json")) if self.root.is_dir() else []:
            try:
                used.update(json.loads(record.read_text()))
            except (OSError, ValueError):
                return []     # an unreadable record: keep everything rather than guess
        removed = []
        for entry in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if len(entry.name) == 64 and entry.name not in used:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return removed

    def sweep(self) -> list[str]:
        """Scratch folders of builds that were killed (their process is gone)."""
        swept = []
        for path in self.root.glob(".tmp-layer-*") if self.root.is_dir() else []:
            pid = path.name.split("-")[3]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                swept.append(path.name)
        return swept
