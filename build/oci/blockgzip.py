"""Gzip on every core, with the same bytes whatever the number of cores (pigz without -i).

The stream is cut into BLOCK-sized pieces by position alone, never by the core count or by how
the writes happened to arrive, and each piece is compressed on its own as raw deflate: primed
with the 32 KiB before it, so the ratio stays within a fraction of a percent of one stream's,
and ended with a sync flush, so the pieces concatenate into one valid deflate stream; the last
ends it. A fixed header (no name, mtime 0, OS 255: what Python's gzip writes for mtime=0) and
the CRC32/ISIZE trailer make the whole a gzip member any reader takes.

Pieces compress on a thread pool (zlib releases the GIL). One ordered thread checksums each
uncompressed piece, shows it to `observe` (a layer's diffID) and writes its compressed bytes to
the sink, in stream order; at most 2 x threads pieces are in flight, so memory is bounded by
the pool, never by the size of the stream.
"""
from __future__ import annotations

import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from build.errors import BuildFailure

# Fixed, never derived from the machine: the cut points are part of the bytes, and so of every
# blob digest. 1 MiB keeps the per-piece cost (a flush, a fresh window) under 0.1% of the size.
BLOCK = 1 << 20
WINDOW = 1 << 15          # deflate's history: what a piece may refer back to
HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
THREADS_ENV = "FTIMAGE_GZIP_THREADS"


def usable_cores() -> int:
    counter = getattr(os, "process_cpu_count", None)       # 3.13+: honours affinity and -X cpu_count
    if counter is not None:
        return counter() or 1
    try:
        return len(os.sched_getaffinity(0)) or 1              # a container's or taskset's share, not the host's
    except AttributeError:
        return os.cpu_count() or 1


def thread_count(environ: Mapping[str, str] = os.environ) -> int:
    """Compressing threads: FTIMAGE_GZIP_THREADS, else every core this process may run on. The
    count changes the speed only, never the bytes."""
    raw = environ.get(THREADS_ENV, "").strip()
    if not raw:
        return usable_cores()
    count = int(raw) if raw.isascii() and raw.isdigit() else 0
    if count < 1:
        raise BuildFailure(f"{THREADS_ENV}={raw!r} is not a positive whole number of threads",
                           fix=f"set {THREADS_ENV} to 1 or more, or unset it to use every core this process may use")
    return count


def _deflate(level: int, piece: bytes, history: bytes, last: bool) -> bytes:
    primed = {"zdict": history} if history else {}
    engine = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS, zlib.DEF_MEM_LEVEL, zlib.Z_DEFAULT_STRATEGY,
                              **primed)
    return engine.compress(piece) + engine.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


class ParallelGzip:
    """A write-only file that gzips what it is given into `sink` on `threads` threads.

    `close()` ends the stream (and re-raises any failure of a worker or of the sink); `abort()`
    drops what is in flight and returns promptly. Not for use from several threads at once."""

    def __init__(self, sink, level: int, *, threads: int | None = None, block: int = BLOCK,
                 observe: Callable[[bytes], object] | None = None):
        threads = thread_count() if threads is None else threads
        if threads < 1 or block < 1:
            raise ValueError(f"threads ({threads}) and block ({block}) must be positive")
        self._sink, self._level, self._block, self._observe = sink, level, block, observe
        self._pending = bytearray()
        self._history = b""
        self._crc = self._length = 0
        self._error: BaseException | None = None
        self._dropping = False
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="layer-gzip")
        # The bound is what keeps memory flat: a full queue holds the tar writer back until the
        # oldest piece is written.
        self._in_order: queue.Queue[tuple[bytes, Future] | None] = queue.Queue(maxsize=2 * threads)
        sink.write(HEADER)
        self._writer = threading.Thread(target=self._write_in_order, name="layer-gzip-writer", daemon=True)
        self._writer.start()

    def write(self, data) -> int:
        self._raise_failure()
        self._pending += data
        while len(self._pending) >= self._block:
            with memoryview(self._pending) as view:
                piece = bytes(view[:self._block])
            del self._pending[:self._block]
            self._submit(piece, last=False)
        return len(data)

    def flush(self) -> None:
        """Nothing to do: a piece is compressed when it is full, and the stream ends at close."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._raise_failure()
            piece = bytes(self._pending)
            self._pending.clear()
            # Even an empty last piece is compressed: Z_FINISH is what marks the stream's end.
            self._submit(piece, last=True)
        finally:
            self._stop()
        self._raise_failure()
        self._sink.write(struct.pack("<II", self._crc, self._length & 0xFFFFFFFF))

    def abort(self) -> None:
        self._dropping = True
        if not self._closed:
            self._closed = True
            self._stop()

    def _submit(self, piece: bytes, *, last: bool) -> None:
        future = self._pool.submit(_deflate, self._level, piece, self._history, last)
        self._history = (self._history + piece)[-WINDOW:] if len(piece) < WINDOW else piece[-WINDOW:]
        self._in_order.put((piece, future))

    def _stop(self) -> None:
        # The writer thread always keeps taking from the queue (it discards after a failure), so
        # this put returns once it has room, and the join once the queued pieces are handled.
        self._in_order.put(None)
        self._writer.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_in_order(self) -> None:
        while (item := self._in_order.get()) is not None:
            piece, future = item
            if self._error is not None or self._dropping:
                future.cancel()
                continue
            try:
                self._crc = zlib.crc32(piece, self._crc)
                self._length += len(piece)
                if self._observe is not None:
                    self._observe(piece)
                self._sink.write(future.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised on the thread that writes and closes
                self._error = exc
