"""Layer gzip on many threads: the same bytes for any thread count and any write pattern, a
stream every gzip reader takes back exactly, memory bounded by the pool, and failures that reach
the writing thread without hanging it."""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import random
import shutil
import subprocess
import threading
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from build.errors import BuildFailure
from build.oci import blockgzip
from build.oci.blockgzip import BLOCK, HEADER, ParallelGzip, thread_count
from build.oci.tarlayer import GZIP_LEVEL, LayerWriter, TreeEntry, write_layer

pytestmark = pytest.mark.unit
EPOCH = 1_700_000_000
THREADS = (1, 2, 3, 16)


def compressible(size: int, seed: int = 0) -> bytes:
    """Text-like bytes: words from a small vocabulary, about 3:1 under deflate."""
    rng = random.Random(seed)
    words = [bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz_", k=rng.randint(2, 9))) for _ in range(400)]
    out = bytearray()
    while len(out) < size:
        out += rng.choice(words) + rng.choice((b" ", b"\n", b"(", b"): "))
    return bytes(out[:size])


def gz(data: bytes, threads: int, *, block: int = BLOCK, writes: list[int] | None = None) -> bytes:
    sink = io.BytesIO()
    writer = ParallelGzip(sink, GZIP_LEVEL, threads=threads, block=block)
    view, at = memoryview(data), 0
    for size in writes or [len(data)]:
        writer.write(view[at:at + size])
        at += size
    writer.write(view[at:])
    writer.close()
    return sink.getvalue()


SIZES = {"empty": 0, "one byte": 1, "one block": BLOCK, "block+1": BLOCK + 1}
INPUTS = {**{name: compressible(size) for name, size in SIZES.items()},
          "random 3 MiB": random.Random(1).randbytes(3 * BLOCK + 12345),
          "compressible 5 MiB": compressible(5 * BLOCK + 777, seed=2)}


@pytest.mark.parametrize("name", list(INPUTS))
def test_the_bytes_are_the_same_for_every_thread_count_and_read_back_exactly(name):
    data = INPUTS[name]
    outputs = {threads: gz(data, threads) for threads in THREADS}
    assert len(set(outputs.values())) == 1, {t: hashlib.sha256(o).hexdigest()[:12] for t, o in outputs.items()}
    stream = outputs[1]
    assert stream[:10] == HEADER and gzip.decompress(stream) == data
    assert stream[-8:] == zlib.crc32(data).to_bytes(4, "little") + (len(data) % 2 ** 32).to_bytes(4, "little")


def one_stream(data: bytes) -> bytes:
    """What layers were before: GzipFile's one stream (OS 255; gzip.compress may write zlib's 3)."""
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=out, mtime=0) as stream:
        stream.write(data)
    return out.getvalue()


def test_the_header_is_the_one_gzipfile_writes_and_a_short_stream_is_its_exact_bytes():
    """Under one piece there is nothing to cut: the stream is byte for byte GzipFile's."""
    assert HEADER == one_stream(b"")[:10]
    for data in (b"", b"x", compressible(100_000)):
        assert gz(data, 4) == one_stream(data)


def test_the_ratio_stays_close_to_one_stream():
    data = INPUTS["compressible 5 MiB"]
    assert len(gz(data, 2)) < len(one_stream(data)) * 1.01


@pytest.mark.skipif(not shutil.which("gzip"), reason="no gzip command")
def test_the_gzip_command_reads_it_back(tmp_path):
    data = INPUTS["random 3 MiB"][:BLOCK] + INPUTS["compressible 5 MiB"][:2 * BLOCK + 5]
    path = tmp_path / "x.gz"
    path.write_bytes(gz(data, 3))
    subprocess.run(["gzip", "-t", str(path)], check=True)
    assert subprocess.run(["zcat", str(path)], capture_output=True, check=True).stdout == data
    empty = tmp_path / "empty.gz"
    empty.write_bytes(gz(b"", 2))
    subprocess.run(["gzip", "-t", str(empty)], check=True)


REPEATED = st.tuples(st.binary(min_size=1, max_size=24), st.integers(1, 120)).map(lambda t: t[0] * t[1])
PIECES = st.lists(st.one_of(st.binary(max_size=300), REPEATED), max_size=12).map(b"".join)   # noise and runs


@settings(max_examples=200, deadline=None)
@given(data=PIECES, block=st.integers(64, 1024), threads=st.sampled_from((2, 3, 16)),
       cuts=st.lists(st.integers(0, 700), max_size=8))
def test_the_bytes_depend_on_the_stream_alone_not_on_threads_or_how_it_was_written(data, block, threads, cuts):
    reference = gz(data, 1, block=block)
    assert gz(data, threads, block=block, writes=cuts) == reference
    assert gzip.decompress(reference) == data


# ---- through the layer writer ----------------------------------------------------------------

def layer_entries() -> list[TreeEntry]:
    return [TreeEntry("opt", "dir", 0o755), TreeEntry("opt/big.bin", "file", data=INPUTS["random 3 MiB"]),
            TreeEntry("opt/text.py", "file", data=compressible(2 * BLOCK + 3, seed=5)),
            TreeEntry("opt/tiny", "file", data=b"x")]


def test_a_layer_is_the_same_bytes_on_one_thread_and_on_eight_and_its_digests_are_right(tmp_path, monkeypatch):
    blobs = {}
    for threads in ("1", "8"):
        monkeypatch.setenv("FTIMAGE_GZIP_THREADS", threads)
        blobs[threads] = write_layer(tmp_path / f"{threads}.tar.gz", layer_entries(), EPOCH)
    one, eight = (tmp_path / "1.tar.gz").read_bytes(), (tmp_path / "8.tar.gz").read_bytes()
    assert one == eight and (blobs["1"].digest, blobs["1"].diff_id) == (blobs["8"].digest, blobs["8"].diff_id)
    assert blobs["1"].digest == "sha256:" + hashlib.sha256(one).hexdigest() and blobs["1"].size == len(one)
    tar = gzip.decompress(one)
    assert blobs["1"].diff_id == "sha256:" + hashlib.sha256(tar).hexdigest()
    assert len(tar) > 5 * BLOCK      # several pieces, so the cut points are exercised


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", "²"])
def test_a_bad_thread_count_is_a_clear_failure_before_any_file_is_made(tmp_path, monkeypatch, value):
    monkeypatch.setenv("FTIMAGE_GZIP_THREADS", value)
    with pytest.raises(BuildFailure) as failed:
        LayerWriter(tmp_path / "x.tar.gz", EPOCH)
    assert "FTIMAGE_GZIP_THREADS" in str(failed.value) and repr(value) in str(failed.value)
    assert "1 or more" in failed.value.fix and not (tmp_path / "x.tar.gz").exists()


def test_the_thread_count_is_every_usable_core_unless_set():
    assert thread_count({}) == blockgzip.usable_cores() >= 1
    assert thread_count({"FTIMAGE_GZIP_THREADS": " 5 "}) == 5
    if hasattr(os, "sched_getaffinity") and not hasattr(os, "process_cpu_count"):
        assert blockgzip.usable_cores() == len(os.sched_getaffinity(0))


# ---- failures and memory -----------------------------------------------------------------------

def failing_after(pieces: int):
    real, calls = blockgzip._deflate, []

    def deflate(*args):
        calls.append(1)
        if len(calls) > pieces:
            raise zlib.error("injected: the compressor broke")
        return real(*args)
    return deflate


def finishes(action, timeout: float = 10.0) -> bool:
    done = threading.Thread(target=action, daemon=True)
    done.start()
    done.join(timeout)
    return not done.is_alive()


def test_a_worker_failure_reaches_the_writing_thread_and_abort_does_not_hang(monkeypatch):
    monkeypatch.setattr(blockgzip, "_deflate", failing_after(2))
    writer = ParallelGzip(io.BytesIO(), GZIP_LEVEL, threads=3, block=4096)
    with pytest.raises(zlib.error, match="injected"):
        for _ in range(200):
            writer.write(b"y" * 4096)
        writer.close()
    assert finishes(writer.abort) and finishes(writer.abort)


def test_a_failure_in_the_last_piece_surfaces_at_close(monkeypatch):
    monkeypatch.setattr(blockgzip, "_deflate", failing_after(0))
    writer = ParallelGzip(io.BytesIO(), GZIP_LEVEL, threads=2)
    writer.write(b"short")
    with pytest.raises(zlib.error, match="injected"):
        writer.close()
    assert finishes(writer.abort)


def test_a_layer_whose_compression_fails_is_an_error_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(blockgzip, "_deflate", failing_after(1))
    monkeypatch.setenv("FTIMAGE_GZIP_THREADS", "4")
    outcome: list[BaseException] = []

    def build():
        try:
            write_layer(tmp_path / "x.tar.gz", layer_entries(), EPOCH)
        except zlib.error as exc:
            outcome.append(exc)
    assert finishes(build) and "injected" in str(outcome[0])


def test_a_sink_failure_reaches_the_writing_thread():
    class Full(io.BytesIO):
        def write(self, data):
            if self.tell() > 0:
                raise OSError(28, "No space left on device")
            return super().write(data)

    writer = ParallelGzip(Full(), GZIP_LEVEL, threads=2, block=1024)
    with pytest.raises(OSError, match="No space left"):
        for _ in range(100):
            writer.write(os.urandom(1024))
        writer.close()
    assert finishes(writer.abort)


def test_a_slow_sink_holds_the_writer_back_so_memory_stays_bounded(monkeypatch):
    calls = []
    real = blockgzip._deflate
    monkeypatch.setattr(blockgzip, "_deflate", lambda *args: calls.append(1) or real(*args))
    release = threading.Event()

    class Slow(io.BytesIO):
        def write(self, data):
            if self.tell() > 0:
                release.wait(10)
            return super().write(data)

    sink, threads = Slow(), 2
    writer = ParallelGzip(sink, GZIP_LEVEL, threads=threads, block=1024)
    data = compressible(200 * 1024)
    feeding = threading.Thread(target=lambda: (writer.write(data), writer.close()), daemon=True)
    feeding.start()
    feeding.join(0.5)
    # queued (2 x threads), one held by the ordered writer, one submitted while waiting for room
    assert feeding.is_alive() and len(calls) <= 2 * threads + 2
    release.set()
    feeding.join(10)
    assert not feeding.is_alive() and gzip.decompress(sink.getvalue()) == data


def test_abort_mid_layer_returns_and_leaves_no_stream_a_reader_would_take(tmp_path):
    writer = LayerWriter(tmp_path / "x.tar.gz", EPOCH)
    writer.add(TreeEntry("big", "file", data=INPUTS["random 3 MiB"]))
    assert finishes(writer.abort)
    with pytest.raises((EOFError, gzip.BadGzipFile)):
        gzip.decompress((tmp_path / "x.tar.gz").read_bytes())
