"""Folders this tool writes into (`--render`, `--out`, the cache) are checked before any write:
never a file, never a non-empty folder this tool did not create unless `--force` says so,
and nothing is ever deleted that this tool did not create.

A folder the tool creates or adopts carries a marker file naming its role. A render replaces
only a folder that carries the render marker; with --force into a foreign folder, the render's
files are written over same-named ones and everything else is left alone.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from contracts import atomic

RENDER_MARKER = ".ftimage-render"
OUTPUT_MARKER = ".ftimage-output"
CACHE_MARKER = ".ftimage-cache"


class UnsafeDirectory(Exception):
    """A folder we were asked to write into is not ours to write (exit code 2)."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


def _owned(path: Path, marker: str) -> bool:
    return (path / marker).is_file()


def _empty(path: Path) -> bool:
    return not any(path.iterdir())


# A cache made before markers existed is recognised by its layout, and adopted.
CACHE_LAYOUT = {"wheels", "sources", "resolutions", "kernels", "scratch"}


def _create_marked(path: Path, marker: str) -> None:
    """Create `path` with its marker already inside, in one rename: a second build starting into the
    same fresh folder sees either no folder or one that is visibly ours, never a half-made one."""
    if path.exists() or path.is_symlink():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = atomic.staging_dir(path.parent, f"claim-{path.name}")
    atomic.write_text(staging / marker, json.dumps({"created_by": "ftimage", "role": marker}) + "\n")
    try:
        os.rename(staging, path)   # replaces nothing but an empty folder; fails if another build won
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def claim(path: Path, marker: str, *, what: str, option: str, force: bool = False) -> Path:
    """Make sure `path` may be written: create it (with its marker) or adopt an empty one;
    refuse a file, a symlink, or a non-empty folder without our marker (unless force)."""
    path = Path(path)
    _create_marked(path, marker)
    if (marker == CACHE_MARKER and path.is_dir() and not path.is_symlink() and not _owned(path, marker)
            and {p.name for p in path.iterdir()} <= CACHE_LAYOUT | {marker}):
        atomic.write_text(path / marker, json.dumps({"created_by": "ftimage", "role": marker}) + "\n")
    if path.is_symlink():
        raise UnsafeDirectory(f"{what} {path} is a symbolic link", f"pass a real folder to {option}")
    if path.exists() and not path.is_dir():
        raise UnsafeDirectory(f"{what} {path} is a file, not a folder", f"pass a folder to {option}")
    if path.is_dir() and not _owned(path, marker) and not _empty(path) and not force:
        raise UnsafeDirectory(
            f"{what} {path} is a non-empty folder this tool did not create",
            f"pass a new or empty folder to {option}, or add --force to write into it (nothing of yours is "
            "deleted; same-named files are overwritten)")
    path.mkdir(parents=True, exist_ok=True)
    if not _owned(path, marker) and (_empty(path) or not force):
        atomic.write_text(path / marker, json.dumps({"created_by": "ftimage", "role": marker}) + "\n")
    return path


def check_render_target(dest: Path, *, force: bool = False) -> None:
    """Refuse a bad --render target before any work (downloads) is spent on rendering."""
    dest = Path(dest)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise UnsafeDirectory(f"render target {dest} is not a folder", "pass a new or empty folder to --render")
    if dest.is_dir() and not _owned(dest, RENDER_MARKER) and not _empty(dest) and not force:
        raise UnsafeDirectory(f"render target {dest} is a non-empty folder this tool did not create",
                              "pass a new or empty folder to --render, or add --force to write the context files "
                              "into it (nothing else there is deleted)")


def publish_render(staging: Path, dest: Path, *, force: bool = False) -> None:
    """Move a fully rendered folder to `dest` under the rules above."""
    dest = Path(dest)
    atomic.write_text(staging / RENDER_MARKER, json.dumps({"created_by": "ftimage", "role": "render"}) + "\n")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeDirectory(f"render target {dest} is not a folder", "pass a new or empty folder to --render")
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, dest)
        return
    if _owned(dest, RENDER_MARKER):
        atomic.publish_dir(staging, dest, replace=True)
        return
    if _empty(dest):
        dest.rmdir()
        os.rename(staging, dest)
        return
    if not force:
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeDirectory(f"render target {dest} is a non-empty folder this tool did not create",
                              "pass a new or empty folder to --render, or add --force to write the context files "
                              "into it (nothing else there is deleted)")
    for item in sorted(staging.rglob("*")):
        target = dest / item.relative_to(staging)
        if item.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(item, target)
    shutil.rmtree(staging, ignore_errors=True)


def staging_beside(dest: Path) -> Path:
    """A staging folder on the same filesystem as dest, so publishing is a rename."""
    parent = Path(dest).absolute().parent
    return atomic.staging_dir(parent, f"render-{Path(dest).name}")
