"""Deterministic layer tarballs: the same entries give the same bytes on any machine.

Every entry has one fixed mtime (the layer's), numeric owners with empty user and group
names, and a mode set by the build (directories 0755, files 0644 or 0755, never setuid).
Extended attributes, ACLs and file capabilities are never read, so none reach the layer.
The tar is gzipped on every core in fixed 1 MiB pieces (build/oci/blockgzip.py: the same bytes
on 2 cores as on 64) and streamed through two sha256s: the uncompressed one is the layer's
diffID, the compressed one its blob digest. Nothing is held in memory but the pieces in
flight, a few per core, so a 6 GB venv layer costs no more RAM than a small one.
"""
from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from build.oci.blockgzip import ParallelGzip, thread_count
from contracts.schema import InvalidInput, Problem

COPY_BUFSIZE = 1 << 20    # a member's bytes go to the compressor in reads this size, not tarfile's 16 KiB
# zlib level 3: measured on the smoke venv (1.38 GB, one thread), 18 s and 407 MiB against level
# 6's 41 s and 375 MiB; level 1 took 13 s for 429 MiB. The level is part of every layer's cache key.
GZIP_LEVEL = 3
DIR_MODE, FILE_MODE, EXEC_MODE = 0o755, 0o644, 0o755


class LayerTreeErrors(InvalidInput):
    """A staged tree holds something a layer cannot carry faithfully (exit 2)."""
    title = "a layer's file tree"


@dataclass(frozen=True)
class Owner:
    uid: int = 0
    gid: int = 0


ROOT = Owner()


@dataclass(frozen=True)
class TreeEntry:
    """One entry of a layer: a folder, a file (its bytes from `source` or `data`), a symlink or
    a hard link to an earlier entry."""
    path: str                      # inside the image, no leading slash
    kind: str                      # "dir" | "file" | "symlink" | "hardlink"
    mode: int = FILE_MODE
    owner: Owner = ROOT
    source: Path | None = None
    data: bytes | None = None
    target: str = ""


@dataclass(frozen=True)
class LayerBlob:
    diff_id: str          # sha256:<hex> of the tar
    digest: str           # sha256:<hex> of the gzip stream
    size: int             # bytes of the gzip stream
    path: Path


class Digesting:
    """A write-only file that hashes what passes through and forwards it."""

    def __init__(self, sink):
        self.sink, self.sha, self.size = sink, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.sink.write(data)

    def flush(self) -> None:
        self.sink.flush()


class _Counting:
    """The compressor as tarfile's plain-file mode wants it: with a position. That mode writes
    each member straight through, where the stream mode ("w|") copies every byte through its
    own buffer twice more; the tar bytes are the same."""

    def __init__(self, sink: ParallelGzip):
        self.sink, self.offset = sink, 0

    def write(self, data) -> int:
        self.offset += len(data)
        return self.sink.write(data)

    def tell(self) -> int:
        return self.offset


class LayerWriter:
    """Write entries into `path` as a gzipped tar; `close()` gives the digests."""

    def __init__(self, path: Path, mtime: int):
        self.path, self.mtime = path, int(mtime)
        threads = thread_count()          # a bad FTIMAGE_GZIP_THREADS fails before any file is made
        self._raw = path.open("wb")
        self._blob = Digesting(self._raw)
        # The diffID is hashed on the compressor's ordered thread, beside the CRC, not on this one:
        # this thread's tar writing is what bounds the speed once deflate runs on many cores.
        self._diff = hashlib.sha256()
        self._gzip = ParallelGzip(self._blob, GZIP_LEVEL, threads=threads, observe=self._diff.update)
        self._tar = tarfile.open(fileobj=_Counting(self._gzip), mode="w", format=tarfile.PAX_FORMAT,
                                 copybufsize=COPY_BUFSIZE)

    def add(self, entry: TreeEntry) -> None:
        info = tarfile.TarInfo(entry.path)
        info.mtime, info.uid, info.gid, info.uname, info.gname = self.mtime, entry.owner.uid, entry.owner.gid, "", ""
        info.mode = entry.mode & 0o1777   # never setuid or setgid
        if entry.kind == "dir":
            info.type = tarfile.DIRTYPE
            self._tar.addfile(info)
        elif entry.kind == "symlink":
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.target, 0o777
            self._tar.addfile(info)
        elif entry.kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, entry.target
            self._tar.addfile(info)
        elif entry.data is not None:
            info.size = len(entry.data)
            self._tar.addfile(info, io.BytesIO(entry.data))
        else:
            assert entry.source is not None
            with entry.source.open("rb") as fh:
                info.size = os.fstat(fh.fileno()).st_size
                self._tar.addfile(info, fh)

    def add_member(self, info: tarfile.TarInfo, fileobj=None) -> None:
        """A member taken as it is from another tar (the base's), with its own times and owners."""
        self._tar.addfile(info, fileobj)

    def close(self) -> LayerBlob:
        self._tar.close()
        self._gzip.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        return LayerBlob(diff_id="sha256:" + self._diff.hexdigest(),
                         digest="sha256:" + self._blob.sha.hexdigest(), size=self._blob.size, path=self.path)

    def abort(self) -> None:
        for closer in (self._tar.close, self._gzip.abort, self._raw.close):
            try:
                closer()
            except Exception:  # noqa: BLE001 - the error being raised already is the one that matters
                pass


def write_layer(path: Path, entries: Iterable[TreeEntry], mtime: int) -> LayerBlob:
    writer = LayerWriter(path, mtime)
    try:
        for entry in entries:
            writer.add(entry)
        return writer.close()     # a failed compression can surface here, with the last piece
    except BaseException:
        writer.abort()
        raise


def parents(path: str) -> list[TreeEntry]:
    """Root-owned 0755 folders for every ancestor of `path` ("opt/ftimage/venv" gives opt and
    opt/ftimage), so a layer never depends on what folders an earlier layer happened to make."""
    parts = path.strip("/").split("/")[:-1]
    return [TreeEntry("/".join(parts[:i]), "dir", DIR_MODE) for i in range(1, len(parts) + 1)]


def tree_entries(root: Path, prefix: str, *, owner: Owner = ROOT,
                 builder_uid: int | None = None) -> Iterator[TreeEntry]:
    """The entries of the staged folder `root`, placed at `prefix` in the image (the folder
    itself included), in sorted order. Modes are normalised; owners are `owner` for all.
    Refused (exit 2, every problem at once): device nodes, FIFOs and sockets, which a layer of
    training code never needs; files owned by anyone but the builder, whose ownership the layer
    could only guess; hard links that leave the tree."""
    builder_uid = os.getuid() if builder_uid is None else builder_uid
    problems: list[Problem] = []
    entries: list[TreeEntry] = []
    seen_inodes: dict[tuple[int, int], str] = {}
    prefix = prefix.strip("/")

    def visit(path: Path, arcname: str) -> None:
        st = path.lstat()
        if st.st_uid != builder_uid:
            problems.append(Problem(str(root), arcname, f"is owned by uid {st.st_uid}, which this layer cannot map "
                                    f"(the build runs as uid {builder_uid})",
                                    "stage the tree as the building user (chown it, or rebuild it)", "unmapped-owner"))
            return
        if stat.S_ISDIR(st.st_mode):
            entries.append(TreeEntry(arcname, "dir", DIR_MODE, owner))
            for child in sorted(os.listdir(path)):
                visit(path / child, f"{arcname}/{child}")
        elif stat.S_ISLNK(st.st_mode):
            entries.append(TreeEntry(arcname, "symlink", 0o777, owner, target=os.readlink(path)))
        elif stat.S_ISREG(st.st_mode):
            mode = EXEC_MODE if st.st_mode & 0o111 else FILE_MODE
            if st.st_nlink > 1:
                first = seen_inodes.setdefault((st.st_dev, st.st_ino), arcname)
                if first != arcname:
                    entries.append(TreeEntry(arcname, "hardlink", mode, owner, target=first))
                    return
            entries.append(TreeEntry(arcname, "file", mode, owner, source=path))
        else:
            kind = ("a device node" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket")
            problems.append(Problem(str(root), arcname, f"is {kind}, which an image layer must not carry",
                                    "remove it from the staged tree", "special-file"))

    visit(root, prefix)
    for first in seen_inodes.values():
        source = root / first[len(prefix):].lstrip("/") if first != prefix else root
        in_tree = sum(1 for e in links_to(entries, first)) + 1
        if source.lstat().st_nlink > in_tree:
            problems.append(Problem(str(root), first, f"has {source.lstat().st_nlink} hard links but only "
                                    f"{in_tree} are in this tree: it shares its bytes with a file outside the layer",
                                    "copy the file into the staged tree instead of linking it", "outside-link"))
    if problems:
        raise LayerTreeErrors(problems)
    yield from entries


def links_to(entries: list[TreeEntry], target: str) -> Iterator[TreeEntry]:
    return (e for e in entries if e.kind == "hardlink" and e.target == target)
