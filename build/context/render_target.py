"""Where a rendered context goes (`--render DIR`, `out/<name>/context`): refused before any work
when it is not a folder this tool may write, then published in one rename. A render replaces only
a folder that carries the render marker; with --force into a foreign folder, the render's files
are written over same-named ones and everything else is left alone (contracts/folder_guard.py).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from contracts import atomic
from contracts.folder_guard import RENDER_MARKER, UnsafeFolder, empty, marker_text, owned


def check_render_target(dest: Path, *, force: bool = False) -> None:
    """Refuse a bad --render target before any work (downloads) is spent on rendering."""
    dest = Path(dest)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise UnsafeFolder(f"render target {dest} is not a folder", "pass a new or empty folder to --render")
    if dest.is_dir() and not owned(dest, RENDER_MARKER) and not empty(dest) and not force:
        raise UnsafeFolder(f"render target {dest} is a non-empty folder this tool did not create",
                              "pass a new or empty folder to --render, or add --force to write the context files "
                              "into it (nothing else there is deleted)")


def publish_render(staging: Path, dest: Path, *, force: bool = False) -> None:
    """Move a fully rendered folder to `dest` under the rules above."""
    dest = Path(dest)
    atomic.write_text(staging / RENDER_MARKER, marker_text("render"))
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeFolder(f"render target {dest} is not a folder", "pass a new or empty folder to --render")
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, dest)
        return
    if owned(dest, RENDER_MARKER):
        atomic.publish_dir(staging, dest, replace=True)
        return
    if empty(dest):
        dest.rmdir()
        os.rename(staging, dest)
        return
    if not force:
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeFolder(f"render target {dest} is a non-empty folder this tool did not create",
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
