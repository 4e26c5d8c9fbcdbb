"""The job's folder (output.dir) is a boundary: the run writes and deletes only inside it, and
never through a symlink planted there.

A shared output volume is writable by other jobs and users. A symlink named `checkpoints`,
`step-00000010`, `metrics.jsonl` or `final` would otherwise make this run resume from, append to
or delete what it points to. So output.dir is resolved once (its own path may go through
symlinks the user chose; `..` is refused), system paths are refused, and everything below it
is opened or listed without following symlinks.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# Refused as output.dir, or as any folder under them ("/" itself only as itself).
SYSTEM_PATHS = ("/etc", "/usr", "/proc", "/sys", "/dev", "/boot", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                "/libx32", "/var/lib", "/opt/ftimage")
MOUNTINFO = Path("/proc/self/mountinfo")


class RunDirError(Exception):
    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}\n  fix: {fix}")
        self.fix = fix


def resolve_output_dir(text: str, cwd: Path | None = None) -> Path:
    """The absolute, symlink-free path of output.dir, or RunDirError."""
    if "\x00" in text or not text.strip():
        raise RunDirError(f"output.dir {text!r} is not a usable path", "set output.dir to a folder on a volume")
    raw = Path(text)
    if ".." in raw.parts:
        raise RunDirError(f"output.dir {text} contains '..'",
                          "write output.dir as a plain path to the folder, without '..'")
    path = Path(os.path.realpath(raw if raw.is_absolute() else (cwd or Path.cwd()) / raw))
    if path == Path("/") or any(path == Path(p) or Path(p) in path.parents for p in SYSTEM_PATHS):
        raise RunDirError(f"output.dir {path} is a system path or inside one",
                          "point output.dir at a mounted volume for this run's outputs, e.g. /out")
    return path


def mount_point(path: Path, mountinfo: str | None = None) -> str | None:
    """The mount point that holds `path` (the longest mount point that is a prefix of it)."""
    try:
        text = mountinfo if mountinfo is not None else MOUNTINFO.read_text()
    except OSError:
        return None
    best = None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = fields[4].encode().decode("unicode_escape")   # mountinfo escapes spaces as \040
        if path == Path(point) or Path(point) in path.parents:
            if best is None or len(point) > len(best):
                best = point
    return best


def in_container() -> bool:
    return Path("/.dockerenv").exists() or bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or \
        os.environ.get("container") in ("docker", "podman", "oci")


def ephemeral_warning(path: Path, mountinfo: str | None = None, container: bool | None = None) -> str | None:
    """In a container, an output.dir on the container's own root filesystem is lost with it."""
    if not (in_container() if container is None else container):
        return None
    if mount_point(path, mountinfo) in (None, "/"):
        return (f"output.dir {path} is not on a mounted volume: checkpoints, metrics and the export are lost "
                "when the container is removed (mount one, e.g. docker run -v $PWD/out:/out ... output.dir=/out)")
    return None


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
        raise RunDirError(f"{path} is {what}; this run only writes into real folders it created",
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
            raise RunDirError(f"{path} is a symlink; this run does not write through it",
                              f"remove {path}, or use a fresh output.dir") from None
        raise
    return os.fdopen(fd, "a")


def read_bytes_nofollow(path: Path, limit: int | None = None) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        return fh.read() if limit is None else fh.read(limit)
