"""Fetch explicitly pinned files (kernel sdists, pure-Python kernel wheels) into the cache.

A file is accepted only if its sha256 matches the manifest; a mismatch is reported with
both digests and nothing is stored. Never an implicit download: only pinned URLs.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from build.cache import CacheLayout, sha256_file
from build.errors import BuildFailure
from build.spec import PinnedFile
from contracts.events import EventLog, Progress
from contracts.redact import mask_url


def fetch_pinned(pinned: PinnedFile, cache: CacheLayout, log: EventLog) -> Path:
    dest = cache.source_path(pinned.sha256, pinned.filename)
    if dest.is_file():
        actual = sha256_file(dest)
        if actual == pinned.sha256:
            return dest
        dest.unlink()  # corrupt cache entry: evict, then fetch again below
        log.emit("sources", f"evicted corrupt cached {pinned.filename}", expected=pinned.sha256[:12],
                 actual=actual[:12])
    if not pinned.url:
        raise BuildFailure(f"{pinned.filename} is not cached and has no pinned URL",
                           "add its url to kernels_manifest.yaml, or import it with `python -m build kernels import`")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(pinned.url, timeout=120) as response:
            size = int(response.headers.get("Content-Length") or 0) or None
            progress = Progress(log, "download", pinned.filename, total=size, min_interval=2.0)
            done = 0
            while block := response.read(1 << 20):
                digest.update(block)
                out.write(block)
                done += len(block)
                progress.update(done, "downloading")
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != pinned.sha256:
            raise BuildFailure(
                f"{pinned.filename} from {mask_url(pinned.url)} has sha256 {digest.hexdigest()}, "
                f"but kernels_manifest.yaml pins {pinned.sha256}: the download is corrupt or tampered",
                "do not re-pin blindly: check the file's origin, then fix the sha256 or the URL")
        os.replace(tmp, dest)
        progress.finish(f"{done >> 20} MiB, sha256 verified")
    except (urllib.error.URLError, OSError) as exc:
        raise BuildFailure(f"cannot download {pinned.filename} from {mask_url(pinned.url)}: {mask_url(str(exc))}",
                           "check network access to the URL, or import the file with "
                           "`python -m build kernels import DIR` from a machine that has it") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest

