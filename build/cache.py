"""The on-disk cache layout (wheels, sources, resolutions, kernel wheels, scratch).

Every entry appears whole or not at all (contracts.atomic): content is written to a
temporary name in the same directory, fsynced, then renamed into place, so a killed build
leaves at most a `.tmp-*` leftover that is never read and is swept on the next run.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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


def _under(root: Path, sha256: str, filename: str) -> Path:
    """root/ab/<sha256>/<filename>, refusing any name that would leave root (the names come
    from specs and resolutions, which are user input)."""
    if len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a sha256: {sha256!r}")
    if not filename or "/" in filename or "\\" in filename or filename in (".", "..") or "\x00" in filename:
        raise ValueError(f"not a plain file name: {filename!r}")
    path = root / sha256[:2] / sha256 / filename
    if not path.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"{filename!r} resolves outside {root}")
    return path


def sha256_file(path: Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def link_or_copy(src: Path, dest: Path) -> None:
    """Place a cached file into a build context cheaply (hard link when on one filesystem)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() or dest.is_symlink():
        dest.unlink()
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
