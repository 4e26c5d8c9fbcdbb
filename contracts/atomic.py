"""Files that appear whole or not at all: write to a temporary name in the same
directory, fsync, rename into place, fsync the directory.

rename(2) is atomic within one filesystem, so a reader (or a process killed halfway)
sees either the old content or the new, never half of it. The only leftovers a kill
can cause are `.tmp-*` names, which no reader ever opens.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file below root, then every directory (so the names are durable too)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    try:
        # mkstemp's 0600 would make shared caches, reports and locks unreadable to other users
        os.fchmod(fd, mode if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, **kwargs) -> None:
    write_bytes(path, text.encode(), **kwargs)


def write_json(path: Path, data: Any, *, indent: int | None = 2, **dump_kwargs) -> None:
    write_text(path, json.dumps(data, indent=indent, **dump_kwargs) + "\n")


def copy_file(src: Path, dest: Path) -> None:
    """Copy src to dest so that dest is either absent or complete."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_dir(staging: Path, dest: Path, *, replace: bool = False) -> bool:
    """Rename a fully written staging directory into place.

    Returns False (and removes staging) if dest already exists and `replace` is off: another
    writer published the same content first. With `replace`, an existing dest is moved
    aside first and removed after, so dest is never missing for longer than two renames.
    """
    staging, dest = Path(staging), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fsync_tree(staging)
    old = None
    if replace and dest.exists():
        old = dest.with_name(f"{TMP_PREFIX}old-{dest.name}-{os.getpid()}")
        os.rename(dest, old)
    try:
        os.rename(staging, dest)
    except OSError:
        if dest.exists() and not replace:
            shutil.rmtree(staging, ignore_errors=True)
            return False
        raise
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return True


def staging_dir(parent: Path, name: str) -> Path:
    """A fresh `.tmp-<name>-XXXX` directory beside where `name` will be published."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=parent))
    path.chmod(0o755)  # mkdtemp's 0700 would make shared caches and checkpoints unreadable to others
    return path
