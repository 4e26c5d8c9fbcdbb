"""Caches that cannot lie: an edited, emptied or truncated pip resolution record is refetched,
never trusted (a torch-less image must not come out tagged as a success); a corrupt cached
kernel wheel is named by --plan and `kernels list`, and left for the next build to replace; a
damaged cached wheel (other bytes at the same size, a FIFO, a sparse giant, a link) is evicted
with one WARN line and downloaded again in the same build, never read past its recorded size; a
wheel linked out of the cache is refused by name, and the wheelhouse never places a link."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import signal
from dataclasses import asdict

import pytest

from build.cache import CacheLayout, UnsafeFile
from build.errors import BuildFailure
from build.resolve import load_plan
from build.spec import MANIFEST_PATH, REPO_ROOT
from build.wheelhouse import Wheel
from contracts.events import EventLog

pytestmark = pytest.mark.unit


def _fake_closure(plan, cache: CacheLayout) -> tuple[Wheel, ...]:
    """The pinned torch plus one more wheel, stored in the cache under their real hashes."""
    import hashlib

    wheels = []
    for name, version, filename in (("torch", plan.toolchain.torch_version, plan.torch_wheel.filename),
                                    ("einops", "0.8.2", "einops-0.8.2-py3-none-any.whl")):
        data = f"{name} bytes".encode()
        sha = plan.torch_wheel.sha256 if name == "torch" else hashlib.sha256(data).hexdigest()
        path = cache.wheel_path(sha, filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        wheels.append(Wheel(name=name, version=version, filename=filename, sha256=sha))
    return tuple(wheels)


@pytest.fixture
def resolver(tmp_path, monkeypatch):
    """resolve_closure with pip replaced by a counter (no network); the torch wheel's bytes
    cannot hash to the pinned sha here, so cached-wheel re-hashing is stubbed out too."""
    from build import wheelhouse

    plan = load_plan(REPO_ROOT / "images" / "smoke", MANIFEST_PATH)
    cache = CacheLayout(tmp_path / "cache")
    downloads = []
    monkeypatch.setattr(wheelhouse, "_download", lambda *a, **k: downloads.append(1) or _fake_closure(plan, cache))
    monkeypatch.setattr(wheelhouse, "verify_cached_wheels", lambda wheels, cache, log: [])

    def resolve():
        return wheelhouse.resolve_closure(("einops==0.8.2",), plan=plan, cache=cache, log=EventLog(quiet=True),
                                          purpose="test")
    return resolve, cache, downloads


def _tamper(record, how: str) -> None:
    data = json.loads(record.read_text())
    if how == "edited":
        data["wheels"][0]["sha256"] = "0" * 64
    elif how == "torch removed, sha recomputed":
        from build.resolve import digest
        data["wheels"] = [w for w in data["wheels"] if w["name"] != "torch"]
        data["sha256"] = digest(data["wheels"])
    if how == "emptied":
        record.write_text("")
    elif how == "truncated":
        record.write_text(record.read_text()[: len(record.read_text()) // 2])
    elif how != "deleted":
        record.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["edited", "emptied", "truncated", "torch removed, sha recomputed"])
def test_a_tampered_resolution_record_is_refetched(resolver, how):
    resolve, cache, downloads = resolver
    first = resolve()
    assert not first.cache_hit and downloads == [1]
    assert resolve().cache_hit and downloads == [1]            # intact: reused, no download
    (record,) = cache.resolutions.glob("*.json")
    _tamper(record, how)
    again = resolve()
    assert not again.cache_hit and downloads == [1, 1]         # refetched, not trusted
    assert any(w.name == "torch" for w in again.wheels)
    assert [asdict(w) for w in again.wheels] == [asdict(w) for w in first.wheels]


def test_a_corrupt_kernel_wheel_is_named_by_plan_and_list_and_not_deleted(tmp_path, run_cli):
    plan = load_plan(REPO_ROOT / "images" / "qwen27b", MANIFEST_PATH)
    conv = next(k for k in plan.kernels if k.name == "causal-conv1d")
    entry = tmp_path / "cache" / "kernels" / conv.key
    entry.mkdir(parents=True)
    wheel = "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    (entry / wheel).write_bytes(b"flipped bits")
    (entry / "meta.json").write_text(json.dumps({"key": conv.key, "wheel": wheel, "sha256": "a" * 64,
                                                 "kernel": "causal-conv1d", "version": "1.7.0"}))
    code, out, err = run_cli(["images/qwen27b", "--plan", "--cache", str(tmp_path / "cache")])
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("causal-conv1d"))
    assert "CORRUPT" in row and wheel in row
    code, out, err = run_cli(["kernels", "list", "--cache", str(tmp_path / "cache")])
    assert code == 0 and f"{conv.key[:16]}  CORRUPT: {wheel} has sha256" in out, out + err
    assert (entry / wheel).exists()          # reported, not silently deleted
    # --plan --json carries the same cache state and compile cost as the table
    code, out, err = run_cli(["images/qwen27b", "--plan", "--json", "--cache", str(tmp_path / "cache")])
    kernels = {k["name"]: k["cache"] for k in json.loads(out)["kernels"]}
    assert kernels["causal-conv1d"]["state"] == "corrupt" and wheel in kernels["causal-conv1d"]["detail"]
    assert kernels["flash-attn"]["state"] == "miss" and "sources" in kernels["flash-attn"]["expected_compile"]
    assert kernels["flash-linear-attention"]["state"] == "n/a"


# ---- damaged cached wheels: evicted and fetched again, never read past their size ----------------

TORCH_BYTES, EINOPS_BYTES = b"torch wheel bytes", b"einops wheel bytes, a little longer"


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """resolve_closure with pip replaced by a local folder of wheels, stored through the real
    `_store` (hashed as they are cached), and a plan that pins that folder's torch, so cached
    wheels are re-verified for real. (resolve, cache, downloads, the log's text)."""
    from build import wheelhouse

    plan = load_plan(REPO_ROOT / "images" / "smoke", MANIFEST_PATH)
    plan = dataclasses.replace(plan, torch_wheel=dataclasses.replace(
        plan.torch_wheel, sha256=hashlib.sha256(TORCH_BYTES).hexdigest()))
    index = tmp_path / "index"
    index.mkdir()
    (index / plan.torch_wheel.filename).write_bytes(TORCH_BYTES)
    (index / "einops-0.8.2-py3-none-any.whl").write_bytes(EINOPS_BYTES)
    cache = CacheLayout(tmp_path / "cache")
    downloads: list[int] = []

    def download(requirements, plan, cache, log):
        downloads.append(1)
        return tuple(sorted((wheelhouse._store(p, cache) for p in sorted(index.iterdir())), key=lambda w: w.name))

    monkeypatch.setattr(wheelhouse, "_download", download)
    stream = io.StringIO()

    def resolve():
        return wheelhouse.resolve_closure(("einops==0.8.2",), plan=plan, cache=cache, log=EventLog(stream=stream),
                                          purpose="test")
    return resolve, cache, downloads, stream


def _einops(cache: CacheLayout, resolution):
    wheel = next(w for w in resolution.wheels if w.name == "einops")
    return wheel, cache.wheel_path(wheel.sha256, wheel.filename)


def _warnings(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().splitlines() if "WARN" in line]


@contextlib.contextmanager
def _within(seconds: int):
    """A read that blocks (a FIFO opened without O_NONBLOCK) fails the test instead of hanging it."""
    def hung(*_):
        raise AssertionError(f"blocked for {seconds}s: a FIFO was read")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_cached_wheel_edited_in_place_is_evicted_and_downloaded_again_in_the_same_build(local_index):
    resolve, cache, downloads, stream = local_index
    first = resolve()
    wheel, path = _einops(cache, first)
    assert wheel.size == len(EINOPS_BYTES)               # the resolution records each wheel's size
    assert resolve().cache_hit and downloads == [1]
    path.write_bytes(bytes(len(EINOPS_BYTES)))            # same size, other bytes
    again = resolve()                                     # no BuildFailure: fetched again, this build
    assert not again.cache_hit and downloads == [1, 1]
    assert again.wheels == first.wheels and path.read_bytes() == EINOPS_BYTES
    edited = hashlib.sha256(bytes(len(EINOPS_BYTES))).hexdigest()
    assert _warnings(stream) == [f"[wheelhouse]: WARN: cached wheel {path} is damaged (sha256 {edited} is not the "
                                 f"locked {wheel.sha256}): evicted, downloading it again"]
    assert resolve().cache_hit and downloads == [1, 1]


@pytest.mark.parametrize("stand_in", ["fifo", "sparse giant", "link inside the cache", "folder"])
def test_a_stand_in_for_a_cached_wheel_is_evicted_unread_and_downloaded_again(local_index, stand_in):
    resolve, cache, downloads, stream = local_index
    wheel, path = _einops(cache, resolve())
    path.unlink()
    stray = cache.wheels / "stray.whl"
    stray.write_bytes(EINOPS_BYTES)                       # even the right bytes: a link is never read
    why = {"fifo": "is not a regular file", "folder": "is not a regular file",
           "sparse giant": f"holds {1 << 30} bytes, but {len(EINOPS_BYTES)} are recorded for it",
           "link inside the cache": f"is a symbolic link to {stray}"}[stand_in]
    if stand_in == "fifo":
        os.mkfifo(path)
    elif stand_in == "folder":
        path.mkdir()
    elif stand_in == "sparse giant":
        with path.open("wb") as fh:
            fh.truncate(1 << 30)
    else:
        path.symlink_to(stray)
    with _within(20):
        again = resolve()
    assert not again.cache_hit and downloads == [1, 1]
    assert not path.is_symlink() and path.read_bytes() == EINOPS_BYTES
    assert stray.read_bytes() == EINOPS_BYTES            # what a link pointed to is left alone
    assert _warnings(stream) == [f"[wheelhouse]: WARN: cached wheel {path} is damaged ({why}): evicted, "
                                 "downloading it again"]


def test_a_wheel_linked_out_of_the_cache_is_refused_by_name_and_never_read(local_index, tmp_path):
    resolve, cache, downloads, _stream = local_index
    _wheel, path = _einops(cache, resolve())
    secret = tmp_path / "outside.whl"
    secret.write_bytes(EINOPS_BYTES)
    path.unlink()
    path.symlink_to(secret)
    with pytest.raises(BuildFailure) as refused:
        resolve()
    assert isinstance(refused.value, UnsafeFile)
    assert str(refused.value) == (f"the cache entry {path} is a symbolic link to {secret}, outside {cache.wheels}: "
                                  "the cache only ever holds files it wrote")
    assert refused.value.fix.startswith(f"remove {path} (nothing was read through it) and build again")
    assert downloads == [1] and secret.read_bytes() == EINOPS_BYTES


@pytest.mark.parametrize("stand_in", ["link inside the cache", "fifo", "sparse giant"])
def test_the_wheelhouse_places_the_cached_file_itself_or_refuses_by_name(tmp_path, stand_in):
    """render_context places wheels without asking the resolver again: the placement itself
    refuses a link, a FIFO and a file of another size than recorded, and leaves no context."""
    from build.context import render_context

    plan = load_plan(REPO_ROOT / "images" / "smoke")
    cache = CacheLayout(tmp_path / "cache")
    wheel = Wheel(name="einops", version="0.8.2", filename="einops-0.8.2-py3-none-any.whl",
                  sha256=hashlib.sha256(EINOPS_BYTES).hexdigest(), size=len(EINOPS_BYTES))
    path = cache.wheel_path(wheel.sha256, wheel.filename)
    path.parent.mkdir(parents=True)
    stray = cache.wheels / "stray.whl"
    stray.write_bytes(EINOPS_BYTES)
    why = {"fifo": "is not a regular file", "link inside the cache": f"is a symbolic link to {stray}",
           "sparse giant": f"holds {1 << 30} bytes, but {len(EINOPS_BYTES)} are recorded for it"}[stand_in]
    if stand_in == "fifo":
        os.mkfifo(path)
    elif stand_in == "sparse giant":
        with path.open("wb") as fh:
            fh.truncate(1 << 30)
    else:
        path.symlink_to(stray)
    with _within(20), pytest.raises(UnsafeFile) as refused:
        render_context(plan, tmp_path / "ctx", wheels=(wheel,), cache=cache, epoch=0)
    assert str(refused.value) == f"the cache entry {path} {why}"
    assert refused.value.fix == f"remove {path.parent} and build again: it is made again and checked against its digest"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]     # no context, no staging left
    path.unlink()
    path.write_bytes(EINOPS_BYTES)
    ctx = render_context(plan, tmp_path / "ctx", wheels=(wheel,), cache=cache, epoch=0)
    placed = ctx.directory / "wheelhouse" / wheel.filename
    assert not placed.is_symlink() and placed.read_bytes() == EINOPS_BYTES


def test_a_wheel_hashed_once_in_a_process_is_hashed_again_after_any_change(tmp_path, monkeypatch):
    """A build verifies overlapping closures; a wheel it already hashed is not hashed again, unless
    the file changed in any way since, even to the same size and mtime."""
    from build import wheelhouse

    cache = CacheLayout(tmp_path / "cache")
    data = b"a wheel's bytes" * 1000
    wheel = Wheel(name="demo", version="1.0", filename="demo-1.0-py3-none-any.whl",
                  sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    path = cache.wheel_path(wheel.sha256, wheel.filename)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    hashed: list[str] = []
    real = wheelhouse.digest_nofollow
    monkeypatch.setattr(wheelhouse, "digest_nofollow", lambda p, size=None: hashed.append(p.name) or real(p, size=size))
    quiet = EventLog(quiet=True)
    assert wheelhouse.verify_cached_wheels((wheel,), cache, quiet) == []
    assert wheelhouse.verify_cached_wheels((wheel,), cache, quiet) == []
    assert hashed == [wheel.filename]                       # the second closure trusted the first hash
    stat = path.stat()
    with open(path, "r+b") as fh:                          # other bytes, same size, same mtime
        fh.write(b"tampered")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    log = io.StringIO()
    assert wheelhouse.verify_cached_wheels((wheel,), cache, EventLog(stream=log)) == [wheel.filename]
    assert hashed == [wheel.filename] * 2 and "is damaged" in log.getvalue()
    assert not path.exists()
