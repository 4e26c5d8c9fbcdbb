"""The one folder guard: a folder this project writes into is its own, and nothing is read or
written through a symlink planted in it.

Two kinds of folder need it. The build's (`--render`, `--out`, the cache) may be a path the user
typed into an existing folder: it is claimed only when it is new, empty, or carries this tool's
marker for that role, unless `--force`. A run's (output.dir) is often a shared volume other jobs
can write to: a symlink named `checkpoints`, `step-00000010`, `metrics.jsonl` or `final` would
otherwise make the run resume from, append to or delete what it points to, so everything below
it is opened, listed and created without following symlinks.

Every refusal is an UnsafeFolder with the fix; nothing is ever deleted that was not created here.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

from contracts import atomic
from contracts.errors import FixableError

# The marker file that says which role this tool created or adopted a folder for.
RENDER_MARKER = ".ftimage-render"
OUTPUT_MARKER = ".ftimage-output"
CACHE_MARKER = ".ftimage-cache"


class UnsafeFolder(FixableError):
    """A folder (or a file in one) is not ours to write or to read through (exit code 2)."""

    exit_code = 2   # build/cli/main.py: EXIT_BAD_SPEC

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


# ---- claimed folders: a marker file names the role this tool created or adopted them for ----

def marker_text(role: str) -> str:
    return json.dumps({"created_by": "ftimage", "role": role}) + "\n"


def owned(path: Path, marker: str) -> bool:
    return (Path(path) / marker).is_file()


def empty(path: Path) -> bool:
    return not any(Path(path).iterdir())


def _create_marked(path: Path, marker: str) -> None:
    """Create `path` with its marker already inside, in one rename: a second process starting into
    the same fresh folder sees either no folder or one that is visibly ours, never a half-made one."""
    if path.exists() or path.is_symlink():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = atomic.staging_dir(path.parent, f"claim-{path.name}")
    atomic.write_text(staging / marker, marker_text(marker))
    try:
        os.rename(staging, path)   # replaces nothing but an empty folder; fails if another process won
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def claim(path: Path, marker: str, *, what: str, option: str, force: bool = False,
          adopt_layout: frozenset[str] = frozenset()) -> Path:
    """Make sure `path` may be written: create it (with its marker) or adopt an empty one; refuse a
    file, a symlink, or a non-empty folder without our marker (unless force). A folder holding only
    the names in `adopt_layout` (made by this tool before markers existed) is adopted."""
    path = Path(path)
    _create_marked(path, marker)
    if (adopt_layout and path.is_dir() and not path.is_symlink() and not owned(path, marker)
            and {p.name for p in path.iterdir()} <= adopt_layout | {marker}):
        atomic.write_text(path / marker, marker_text(marker))
    if path.is_symlink():
        raise UnsafeFolder(f"{what} {path} is a symbolic link", f"pass a real folder to {option}")
    if path.exists() and not path.is_dir():
        raise UnsafeFolder(f"{what} {path} is a file, not a folder", f"pass a folder to {option}")
    if path.is_dir() and not owned(path, marker) and not empty(path) and not force:
        raise UnsafeFolder(
            f"{what} {path} is a non-empty folder this tool did not create",
            f"pass a new or empty folder to {option}, or add --force to write into it (nothing of yours is "
            "deleted; same-named files are overwritten)")
    path.mkdir(parents=True, exist_ok=True)
    if not owned(path, marker) and (empty(path) or not force):
        atomic.write_text(path / marker, marker_text(marker))
    return path


# ---- below a folder: never through a symlink ----

def real_dir(path: Path, *, create: bool = True) -> Path:
    """`path` as a real directory (created if missing), never a symlink to one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafeFolder(f"{path} is {what}; this run only writes into real folders it created",
                           f"remove {path} (nothing was read through it), or use a fresh output.dir")
    return path


def is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def open_append_nofollow(path: Path):
    """Open for appending without following a symlink (O_NOFOLLOW): a planted `metrics.jsonl ->
    /elsewhere` is refused instead of appended to."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFolder(f"{path} is a symlink; this run does not write through it",
                               f"remove {path}, or use a fresh output.dir") from None
        raise
    return os.fdopen(fd, "a")


def read_bytes_nofollow(path: Path, limit: int | None = None) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        return fh.read() if limit is None else fh.read(limit)
