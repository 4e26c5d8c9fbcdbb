"""The remote cache's requests, through the one registry client (build/publish/registry.py: its
auth from `docker login`, its plain HTTP for loopback only), with a stated timeout on every one.

Each request has `timeout` seconds to connect and `timeout` seconds between bytes. A blob's
transfer also has a deadline (`timeout` plus its size at MIN_RATE), so a server that trickles a
byte a minute cannot hold a build forever either. Blobs are streamed to and from files in
chunks: a venv layer is gigabytes and never sits in memory. What a registry serves is checked
against its digest as it arrives; a blob that is missing or does not match is the entry's
fault (BlobProblem), a registry that cannot answer is RegistryError.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from build.oci.image import sha256_digest
from build.publish.registry import Registry, RegistryError, _cause
from build.remote_cache.wire import MAX_MANIFEST, WireError

CHUNK = 1 << 20
MIN_RATE = 1 << 20          # bytes per second a blob transfer may not fall below, on average


class BlobProblem(WireError):
    """A blob an entry names is missing, or is not what its descriptor says."""


class CacheRegistry(Registry):
    def __init__(self, registry: str, *, timeout: float, plain_http: bool = False, session=None):
        super().__init__(registry, session, plain_http=plain_http)
        self.timeout = timeout
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self.blobs_mounted = 0

    def _send(self, method: str, url: str, *, authorize: bool = True, **kw):
        kw.setdefault("timeout", (self.timeout, self.timeout))
        return super()._send(method, url, authorize=authorize, **kw)

    def _deadline(self, size: int) -> float:
        return time.monotonic() + self.timeout + size / MIN_RATE

    # ---- reads --------------------------------------------------------------------------------

    def get_manifest(self, path: str, tag: str) -> bytes | None:
        """The manifest under `tag`, or None when the registry has none."""
        answer = self._send("GET", f"{self.base}/{path}/manifests/{tag}",
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, stream=True)
        if answer.status_code == 404:
            return None
        self._check(answer, f"serve the manifest {tag[:80]}")
        data = self._read(answer, MAX_MANIFEST + 1, self._deadline(MAX_MANIFEST))
        self.bytes_pulled += len(data)
        return data

    def small_blob(self, path: str, digest: str, limit: int) -> bytes:
        """A small blob (meta.json, layer.json), whole, checked against its digest."""
        answer = self._blob_answer(path, digest)
        data = self._read(answer, limit + 1, self._deadline(limit))
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
        answer = self._blob_answer(path, digest)
        deadline = self._deadline(size)
        sha, got = hashlib.sha256(), 0
        try:
            with open(dest, "wb") as out:
                for chunk in answer.raw.stream(CHUNK, decode_content=False):
                    got += len(chunk)
                    if got > size:
                        raise BlobProblem(f"blob {digest[:19]} is longer than the {size} bytes its entry says")
                    if time.monotonic() > deadline:
                        raise RegistryError(f"{self.registry} sent blob {digest[:19]} slower than "
                                            f"{MIN_RATE >> 20} MiB/s", "check the network to the registry")
                    sha.update(chunk)
                    if feed is not None:
                        feed(chunk)
                    out.write(chunk)
        except _network_errors() as exc:
            raise RegistryError(f"lost {self.registry} while downloading blob {digest[:19]}: {_cause(exc)}",
                                "check the network to the registry") from None
        finally:
            self.bytes_pulled += got
        if got != size or "sha256:" + sha.hexdigest() != digest:
            raise BlobProblem(f"blob {digest[:19]} ({got} bytes) does not match its digest and size ({size})")

    def _blob_answer(self, path: str, digest: str):
        answer = self._send("GET", f"{self.base}/{path}/blobs/{digest}", stream=True)
        if answer.status_code == 404:
            raise BlobProblem(f"the manifest points at blob {digest[:19]}, which the registry does not have")
        return self._check(answer, f"serve the blob {digest[:19]}")

    def _read(self, answer, limit: int, deadline: float) -> bytes:
        parts, got = [], 0
        try:
            for chunk in answer.raw.stream(64 << 10, decode_content=True):
                parts.append(chunk)
                got += len(chunk)
                if got >= limit or time.monotonic() > deadline:
                    break
        except _network_errors() as exc:
            raise RegistryError(f"lost {self.registry} mid-answer: {_cause(exc)}",
                                "check the network to the registry") from None
        return b"".join(parts)

    # ---- writes -------------------------------------------------------------------------------

    def push_bytes(self, path: str, data: bytes) -> str:
        digest = sha256_digest(data)
        if not self.has_blob(path, digest):
            self._check(self._send("PUT", self._start_upload(path), params={"digest": digest}, data=data,
                                   headers={"Content-Type": "application/octet-stream"}), "store a blob")
            self.bytes_pushed += len(data)
        return digest

    def push_file(self, path: str, file: Path, digest: str, size: int, mount_from: str = "") -> str:
        """Store a blob from a file, streamed: "present" when the repository has it already
        (HEAD before PUT), "mounted" when the registry linked it from `mount_from` (a repository
        on the same registry the image was pushed to), else "uploaded"."""
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


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a streamed body raises when the connection fails or stalls mid-transfer: urllib3's
    own errors (a read timeout) reach the caller unwrapped by requests."""
    import requests
    import urllib3

    return (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)
