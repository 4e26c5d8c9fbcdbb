"""The on-disk cache layout (wheels, sources, resolutions, kernel wheels, scratch).

Every entry appears whole or not at all (contracts.atomic): content is written to a
temporary name in the same directory, fsynced, then renamed into place, so a killed build
leaves at most a `.tmp-*` leftover that is never read and is swept on the next run.
Nothing is read out of the cache through a symbolic link, and no file further than the size it
had when opened (or was recorded with): such an entry is an UnsafeFile, named with its fix.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from build.errors import BuildFailure

CACHE_ENV = "FTIMAGE_CACHE"
MARKER = ".ftimage-cache"   # written into a cache root this tool created or adopted


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ftimage"


# A cache made before marker files existed is recognised by its layout, and adopted.
CACHE_LAYOUT = frozenset({"wheels", "sources", "resolutions", "kernels", "scratch"})


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
    def layers(self) -> Path:
        return self.root / "layers"

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    def wheel_path(self, sha256: str, filename: str) -> Path:
        return _under(self.wheels, sha256, filename)

    def source_path(self, sha256: str, filename: str) -> Path:
        return _under(self.sources, sha256, filename)

    @contextmanager
    def scratch_dir(self, what: str):
        """A scratch folder named after this process, removed when done; one a killed build
        left behind is swept by the next build (sweep_scratch)."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f".tmp-{what}-{os.getpid()}-", dir=self.scratch))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def sweep_scratch(self) -> list[str]:
        """Remove scratch folders whose process is gone (a build killed with SIGKILL)."""
        swept = []
        if not self.scratch.is_dir():
            return swept
        for path in self.scratch.iterdir():
            match = re.match(r"\.tmp-[a-z-]+-(\d+)-", path.name)
            if match and not _alive(int(match.group(1))):
                shutil.rmtree(path, ignore_errors=True)
                swept.append(path.name)
        return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class UnsafeFile(BuildFailure, ValueError):
    """A file a copy or a hash check will not read: a symbolic link, not a regular file, not the
    size recorded for it, or bytes that changed while they were read. A ValueError too, so code
    that proves an entry (kernel import, the remote cache) reports it as one more reason."""


def _under(root: Path, sha256: str, filename: str) -> Path:
    """root/ab/<sha256>/<filename>, refusing any name that would leave root (the names come
    from specs and resolutions, which are user input)."""
    if len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a sha256: {sha256!r}")
    if not filename or "/" in filename or "\\" in filename or filename in (".", "..") or "\x00" in filename:
        raise ValueError(f"not a plain file name: {filename!r}")
    path = root / sha256[:2] / sha256 / filename
    if not path.resolve().is_relative_to(root.resolve()):
        link = next((p for p in (path.parent.parent, path.parent, path) if p.is_symlink()), path)
        raise UnsafeFile(f"the cache entry {link} is a symbolic link to {os.path.realpath(link)}, outside {root}: "
                         "the cache only ever holds files it wrote",
                         f"remove {link} (nothing was read through it) and build again: the file is fetched "
                         "again and checked against its sha256")
    return path


def sha256_file(path: Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def open_regular(path: Path, *, size: int | None = None) -> tuple[int, int]:
    """A descriptor of `path` itself and its size then: a symbolic link is never followed and a
    FIFO never blocks the build (O_NONBLOCK, then refused as not a regular file); with `size`, a
    file of another size is refused before a byte is read (a sparse 1 GiB stand-in costs nothing).
    Whoever reads it reads no further than that size: it is all that was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{path} is a symbolic link to {os.path.realpath(path)}",
                             f"remove {path}: only the file itself is read, never a link") from None
        if exc.errno == errno.ENXIO:   # a socket
            raise UnsafeFile(f"{path} is not a regular file", f"remove {path}") from None
        if exc.errno == errno.ENOENT:
            raise UnsafeFile(f"{path} does not exist", f"restore {path}, or remove what names it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else \
            f"holds {st.st_size} bytes, but {size} are recorded for it"
        raise UnsafeFile(f"{path} {what}", f"remove {path}")
    os.set_blocking(fd, True)
    return fd, st.st_size


def _copy_fd(fd: int, limit: int, path: Path, dest: Path, sha256: str | None) -> str:
    """Copy the `limit` bytes `fd` held when it was opened to a new file `dest`, hashing them as
    they go: a file that grows or shrinks meanwhile, or whose bytes are not `sha256`, leaves no
    `dest`."""
    digest, copied = hashlib.sha256(), 0
    # O_EXCL: a name already at dest (a symbolic link planted there, say) is never written through
    out_fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(out_fd, "wb") as out, os.fdopen(os.dup(fd), "rb") as fh:
            os.fchmod(out.fileno(), 0o644)    # whatever the umask: contexts and caches are read by others
            while block := fh.read(min(1 << 20, limit + 1 - copied)):
                copied += len(block)
                if copied > limit:
                    raise UnsafeFile(f"{path} grew while it was copied (past the {limit} bytes it held)",
                                     f"make sure nothing writes to {path}, then build again")
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if copied != limit:
            raise UnsafeFile(f"{path} shrank while it was copied ({copied} of {limit} bytes)",
                             f"make sure nothing writes to {path}, then build again")
        if sha256 is not None and digest.hexdigest() != sha256:
            raise UnsafeFile(f"{path} has sha256 {digest.hexdigest()}, but {sha256} is recorded for it",
                             f"restore {path}, or remove it so it is made again")
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def copy_nofollow(src: Path, dest: Path, *, size: int | None = None, sha256: str | None = None) -> str:
    """Copy the regular file `src` (never through a link, see open_regular) to a new `dest`,
    reading no more bytes than it held when opened (or `size`); returns the sha256 of the bytes
    copied, and refuses (leaving no `dest`) if `sha256` is given and they are not it."""
    fd, limit = open_regular(src, size=size)
    try:
        return _copy_fd(fd, limit, src, dest, sha256)
    finally:
        os.close(fd)


def digest_nofollow(path: Path, *, size: int | None = None) -> tuple[str, int]:
    """(sha256, size) of a file read as copy_nofollow reads it: the file itself, no further than
    the size it had when opened (or `size`)."""
    fd, limit = open_regular(path, size=size)
    digest, read = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as fh:
        while block := fh.read(min(4 << 20, limit + 1 - read)):
            read += len(block)
            if read > limit:
                raise UnsafeFile(f"{path} grew while it was hashed (past {limit} bytes)", f"remove {path}")
            digest.update(block)
    return digest.hexdigest(), read


def link_or_copy(src: Path, dest: Path, *, size: int | None = None) -> None:
    """Place a cached file into a build context cheaply (hard link when on one filesystem). The
    file itself is placed, never what a link planted in the cache points to, and with `size`
    only a file of that size: a cache entry is only ever a regular file this tool wrote."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() or dest.is_symlink():
        dest.unlink()
    try:
        fd, limit = open_regular(src, size=size)
    except UnsafeFile as exc:
        raise UnsafeFile(f"the cache entry {exc}", f"remove {src.parent} and build again: it is made again and "
                         "checked against its digest") from None
    try:
        st = os.fstat(fd)
        try:
            os.link(src, dest, follow_symlinks=False)
        except OSError:
            _copy_fd(fd, limit, src, dest, None)
            return
        placed = os.lstat(dest)
        if (placed.st_dev, placed.st_ino) != (st.st_dev, st.st_ino):   # src was swapped since it was opened
            dest.unlink()
            raise UnsafeFile(f"the cache entry {src} was replaced while it was placed",
                             f"make sure nothing else writes to {src.parent}, then build again")
    finally:
        os.close(fd)
