"""The job's folder (output.dir), resolved once before any rank starts: its own path may go
through symlinks the user chose, but `..` and system paths are refused, and in a container a
folder on the container's own root filesystem (lost with it) is warned about. Everything below it
is opened and listed through contracts/folder_guard.py, never through a planted symlink.
"""
from __future__ import annotations

import os
from pathlib import Path

from contracts.folder_guard import UnsafeFolder

# Refused as output.dir, or as any folder under them ("/" itself only as itself).
SYSTEM_PATHS = ("/etc", "/usr", "/proc", "/sys", "/dev", "/boot", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                "/libx32", "/var/lib", "/opt/ftimage")
MOUNTINFO = Path("/proc/self/mountinfo")


def resolve_output_dir(text: str, cwd: Path | None = None) -> Path:
    """The absolute, symlink-free path of output.dir, or UnsafeFolder."""
    if "\x00" in text or not text.strip():
        raise UnsafeFolder(f"output.dir {text!r} is not a usable path", "set output.dir to a folder on a volume")
    raw = Path(text)
    if ".." in raw.parts:
        raise UnsafeFolder(f"output.dir {text} contains '..'",
                          "write output.dir as a plain path to the folder, without '..'")
    path = Path(os.path.realpath(raw if raw.is_absolute() else (cwd or Path.cwd()) / raw))
    if path == Path("/") or any(path == Path(p) or Path(p) in path.parents for p in SYSTEM_PATHS):
        raise UnsafeFolder(f"output.dir {path} is a system path or inside one",
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
