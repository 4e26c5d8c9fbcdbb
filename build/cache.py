"""The on-disk cache (wheels, sources, resolutions, kernel wheels) and atomic writes into it.

Every entry appears whole or not at all: content is written to a temporary name in the
same directory, fsynced, then renamed into place, so a killed build leaves at most a
`.tmp-*` leftover that is never read.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "FTIMAGE_CACHE"


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ftimage"


@dataclass(frozen=True)
class CacheLayout:
    root: Path

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    @property
    def sources(self) -> Path:
        return self.root / "sources"

    @property
    def resolutions(self) -> Path:
        return self.root / "resolutions"

    @property
    def kernels(self) -> Path:
        return self.root / "kernels"

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    def wheel_path(self, sha256: str, filename: str) -> Path:
        return self.wheels / sha256[:2] / sha256 / filename

    def source_path(self, sha256: str, filename: str) -> Path:
        return self.sources / sha256[:2] / sha256 / filename


def sha256_file(path: Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_copy(src: Path, dest: Path) -> None:
    """Copy src to dest so that dest is either absent or complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_publish_dir(staging: Path, dest: Path) -> bool:
    """Rename a fully written staging directory into place. False if dest already exists."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    try:
        os.rename(staging, dest)
    except OSError:
        if dest.exists():
            shutil.rmtree(staging, ignore_errors=True)
            return False
        raise
    _fsync_dir(dest.parent)
    return True


def link_or_copy(src: Path, dest: Path) -> None:
    """Place a cached file into a build context cheaply (hard link when on one filesystem)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        dest.unlink()
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)

