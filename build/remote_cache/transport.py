"""The remote cache's requests, through the one registry client (build/publish/registry.py: its
auth from `docker login`, its plain HTTP for loopback only), each with a wall-clock bound.

Each request (a manifest, a small blob, a HEAD) has `timeout` seconds in all, from connecting to
its last byte; a blob's transfer has `timeout` plus its size at MIN_RATE. The bound is real: a
watchdog cuts the connection at the deadline (build/publish/deadline.py), so a server that
trickles a byte a second, or sends its headers and then nothing, costs the stated seconds and
no more. The whole build also has a budget (`budget`, 30 timeouts by default): once the
registry has taken that long in all, every further request fails at once, and the cache is
marked unavailable. Blobs are streamed to and from files in chunks: a venv layer is gigabytes
and never sits in memory. What a registry serves is checked against its digest as it arrives;
a blob that is missing or does not match is the entry's fault (BlobProblem), a registry that
cannot answer in time is RegistryError.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from build.oci.image import sha256_digest
from build.publish.deadline import Deadline, running
from build.publish.registry import Registry, RegistryError
from build.remote_cache.options import BUDGET_TIMEOUTS
from build.remote_cache.wire import MAX_MANIFEST, WireError

CHUNK = 1 << 20
MIN_RATE = 1 << 20          # bytes per second a blob transfer may not fall below, on average


class BlobProblem(WireError):
    """A blob an entry names is missing, or is not what its descriptor says."""


class CacheRegistry(Registry):
    late_fix = "check the network to the registry (or raise --cache-timeout)"

    def __init__(self, registry: str, *, timeout: float, budget: float | None = None, plain_http: bool = False,
                 session=None):
        super().__init__(registry, session, plain_http=plain_http, timeout=timeout)
        self.budget = timeout * BUDGET_TIMEOUTS if budget is None else budget
        self.spent = 0.0            # seconds this build's requests have taken, in all
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self.blobs_mounted = 0

    @contextmanager
    def _operation(self, what: str, seconds: float | None = None) -> Iterator[Deadline]:
        """Registry._operation, within what is left of the build's budget (and counted in it)."""
        if running() is not None:           # part of an operation already counted
            with super()._operation(what, seconds) as bound:
                yield bound
            return
        left = self.budget - self.spent
        if left <= 0:
            raise self._spent()
        seconds = self.timeout if seconds is None else seconds
        started = time.monotonic()
        try:
            with super()._operation(what, min(seconds, left)) as bound:
                yield bound
        except RegistryError:
            if seconds > left and time.monotonic() - started >= left:
                raise self._spent() from None
            raise
        finally:
            self.spent += time.monotonic() - started

    def _spent(self) -> RegistryError:
        return RegistryError(f"{self.registry} has taken this build's whole registry time budget "
                             f"({self.budget:g}s, {BUDGET_TIMEOUTS} times --cache-timeout)",
                             "check the network to the registry; the build goes on without it")

    # ---- reads --------------------------------------------------------------------------------

    def get_manifest(self, path: str, tag: str) -> bytes | None:
        """The manifest under `tag`, or None when the registry has none."""
        with self._operation(f"serve the manifest {tag[:80]}"):
            answer = self._send("GET", f"{self.base}/{path}/manifests/{tag}",
                                headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, stream=True)
            if answer.status_code == 404:
                return None
            self._check(answer, f"serve the manifest {tag[:80]}")
            data = self._read(answer, MAX_MANIFEST + 1)
        self.bytes_pulled += len(data)
        return data

    def small_blob(self, path: str, digest: str, limit: int) -> bytes:
        """A small blob (meta.json, layer.json), whole, checked against its digest."""
        with self._operation(f"send blob {digest[:19]}", self.timeout + limit / MIN_RATE):
            data = self._read(self._blob_answer(path, digest), limit + 1)
        self.bytes_pulled += len(data)
        if len(data) > limit:
            raise BlobProblem(f"blob {digest[:19]} is over {limit} bytes")
        if sha256_digest(data) != digest:
            raise BlobProblem(f"blob {digest[:19]} does not match its digest")
        return data

    def download(self, path: str, digest: str, size: int, dest: Path,
                 feed: Callable[[bytes], None] | None = None) -> None:
        """Stream a blob into `dest` (hashing as it goes, and handing each chunk to `feed`);
        BlobProblem unless exactly `size` bytes with `digest` arrived."""
        sha, got = hashlib.sha256(), 0
        try:
            with self._operation(f"send blob {digest[:19]} ({size} bytes) at {MIN_RATE >> 20} MiB/s or faster",
                                 self.timeout + size / MIN_RATE), open(dest, "wb") as out:
                answer = self._blob_answer(path, digest)
                for chunk in answer.raw.stream(CHUNK, decode_content=False):
                    got += len(chunk)
                    if got > size:
                        raise BlobProblem(f"blob {digest[:19]} is longer than the {size} bytes its entry says")
                    sha.update(chunk)
                    if feed is not None:
                        feed(chunk)
                    out.write(chunk)
        finally:
            self.bytes_pulled += got
        if got != size or "sha256:" + sha.hexdigest() != digest:
            raise BlobProblem(f"blob {digest[:19]} ({got} bytes) does not match its digest and size ({size})")

    def _blob_answer(self, path: str, digest: str):
        answer = self._send("GET", f"{self.base}/{path}/blobs/{digest}", stream=True)
        if answer.status_code == 404:
            raise BlobProblem(f"the manifest points at blob {digest[:19]}, which the registry does not have")
        return self._check(answer, f"serve the blob {digest[:19]}")

    @staticmethod
    def _read(answer, limit: int) -> bytes:
        """At most `limit` bytes of the answer (its deadline is the operation's)."""
        parts, got = [], 0
        for chunk in answer.raw.stream(64 << 10, decode_content=True):
            parts.append(chunk)
            got += len(chunk)
            if got >= limit:
                break
        return b"".join(parts)

    # ---- writes -------------------------------------------------------------------------------

    def push_bytes(self, path: str, data: bytes) -> str:
        digest = sha256_digest(data)
        with self._operation(f"store blob {digest[:19]}", self.timeout + len(data) / MIN_RATE):
            if not self.has_blob(path, digest):
                self._check(self._send("PUT", self._start_upload(path), params={"digest": digest}, data=data,
                                       headers={"Content-Type": "application/octet-stream"}), "store a blob")
                self.bytes_pushed += len(data)
        return digest

    def push_file(self, path: str, file: Path, digest: str, size: int, mount_from: str = "") -> str:
        """Store a blob from a file, streamed: "present" when the repository has it already
        (HEAD before PUT), "mounted" when the registry linked it from `mount_from` (a repository
        on the same registry the image was pushed to), else "uploaded"."""
        with self._operation(f"store blob {digest[:19]} ({size} bytes) at {MIN_RATE >> 20} MiB/s or faster",
                             self.timeout + size / MIN_RATE):
            if self.has_blob(path, digest):
                return "present"
            location = ""
            if mount_from and mount_from != path:
                answer = self._send("POST", f"{self.base}/{path}/blobs/uploads/",
                                    params={"mount": digest, "from": mount_from})
                if answer.status_code == 201:
                    self.blobs_mounted += 1
                    return "mounted"
                self._check(answer, "start an upload")
                location = answer.headers.get("Location", "")   # 202: no mount, an upload session instead
                if location.startswith("/"):
                    location = self.base.rsplit("/v2", 1)[0] + location
            location = location or self._start_upload(path)
            with open(file, "rb") as fh:
                self._check(self._send("PUT", location, params={"digest": digest}, data=fh,
                                       timeout=(self.timeout, self.timeout + size / MIN_RATE),
                                       headers={"Content-Type": "application/octet-stream",
                                                "Content-Length": str(size)}), f"store the blob {digest[:19]}")
        self.bytes_pushed += size
        return "uploaded"
