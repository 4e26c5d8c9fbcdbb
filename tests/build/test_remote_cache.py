"""The remote cache (`--cache-registry`) against a real OCI registry (Debian's docker-registry as a
child process, no Docker engine): a real kernel entry (a tiny wheel with SASS in a fatbin, made by
tests/build/kernel_wheels.py, and its meta.json) and a real layer (tarlayer.write_layer) pushed,
fetched into fresh caches and re-hashed; then every way an entry or a registry can be wrong, each
a WARN and a local rebuild with nothing half-written: a wheel that is not its key's, a meta.json
naming another key, a missing blob, another signer, no signature, another artifact type, a
registry answering 500 or never answering, a key with a path in it; concurrent pushes of one key;
credentials never echoed."""
from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from build import signing
from build.cache import CacheLayout
from build.kernels.acceptance import Expected
from build.kernels.store import KernelStore
from build.oci.layercache import LayerCache, layer_key
from build.oci.runtime_image import layer_state
from build.oci.tarlayer import TreeEntry, write_layer
from build.remote_cache import RemoteCache, wire
from build.remote_cache.options import RemoteCacheOptions
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.trust import sign_entry, signature_tag
from build.resolve import load_plan
from build.spec import REPO_ROOT
from contracts.events import EventLog
from tests.build import kernel_wheels
from tests.conftest import run_build_cli

pytestmark = pytest.mark.unit


def make_kernel(root: Path, payload: bytes = b"kernel", version: str = "1.7.0") -> KernelStore:
    """A cache entry as a compile publishes it: a real wheel zip with SASS for its archs, its
    meta.json, a build log."""
    store = KernelStore(CacheLayout(root))
    kernel_wheels.publish(store, kernel_wheels.key_inputs(version=version), payload=payload)
    return store


def wanted(entry) -> Expected:
    """What a build asks the registry for: the entry's key with its own inputs."""
    return Expected(entry.key, entry.meta["inputs"], kernel_wheels.TORCH)


def only_entry(store: KernelStore):
    (entry,) = store.entries()
    return entry


def make_layer(root: Path, text: bytes = b"print('app')\n"):
    cache = LayerCache(root)
    entries = [TreeEntry("opt", "dir", mode=0o755), TreeEntry("opt/app.py", "file", data=text)]
    key = layer_key("app", {"text": hashlib.sha256(text).hexdigest()})
    return cache, cache.get_or_make(key, "app", "ftimage app", 1700000000,
                                    lambda path: write_layer(path, entries, 1700000000))


class Log:
    def __init__(self):
        self.stream = io.StringIO()
        self.log = EventLog(stream=self.stream)

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def warnings(self) -> list[str]:
        return [line for line in self.text.splitlines() if "WARN" in line]


def remote(address: str, repo: str, *, sign=None, public=None, trust: bool = False, timeout: float = 10,
           log: Log | None = None) -> RemoteCache:
    log = log or Log()
    options = RemoteCacheOptions(registry=address, path=repo, timeout=timeout, sign_key=sign, public_key=public,
                                 trust_unsigned=trust)
    cache = RemoteCache(options, log.log)
    cache.test_log = log
    return cache


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(".tmp-*")) if root.exists() else []


# ---- the format ----------------------------------------------------------------------------

def test_wire_format_is_orases_artifact_layout(tmp_path):
    from build.remote_cache.kernel_entries import kernel_manifest

    entry = only_entry(make_kernel(tmp_path / "c"))
    manifest, _ = kernel_manifest(entry)
    body = json.loads(manifest)
    assert body["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert body["artifactType"] == "application/vnd.ftimage.kernel.v1"
    assert body["config"] == {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                              "digest": "sha256:" + hashlib.sha256(b"{}").hexdigest()}
    wheel, meta = body["layers"]
    assert wheel["mediaType"] == wire.WHEEL_MEDIA and wheel["digest"] == "sha256:" + entry.sha256
    assert wheel["annotations"] == {"org.opencontainers.image.title": entry.meta["wheel"]}
    assert meta["mediaType"] == wire.KERNEL_META_MEDIA
    assert wire.parse_manifest(manifest, wire.KERNEL_ARTIFACT, wire.KERNEL_LIMITS)[wire.WHEEL_MEDIA].size == \
        entry.wheel.stat().st_size
    assert wire.kernel_tag("a" * 64) == "kernel-" + "a" * 64 and wire.layer_tag("b" * 64) == "layer-" + "b" * 64


@pytest.mark.parametrize("key", ["../" + "a" * 61, "a" * 63 + "\n", "A" * 64, "a" * 63, "a" * 65, "", "a/" * 32,
                                 "a" * 63 + "\x00"])
def test_a_key_that_is_not_64_lowercase_hex_is_refused(key):
    with pytest.raises(wire.WireError, match="not a cache key"):
        wire.kernel_tag(key)


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m.update(artifactType="application/vnd.ftimage.layer.v1"), "artifact type"),
    (lambda m: m["config"].update(mediaType="application/vnd.oci.image.config.v1+json"), "media type"),
    (lambda m: m["layers"][0].update(size=1 << 40), "claims"),
    (lambda m: m["layers"][0].update(size=-1), "claims"),
    (lambda m: m["layers"].append(dict(m["layers"][0])), "layers, expected 2"),
    (lambda m: m["layers"][1].update(mediaType=m["layers"][0]["mediaType"]), "two"),
    (lambda m: m["layers"][0].update(digest="sha256:../../etc"), "no sha256 digest"),
])
def test_a_manifest_of_another_shape_is_refused(tmp_path, edit, reason):
    from build.remote_cache.kernel_entries import kernel_manifest

    body = json.loads(kernel_manifest(only_entry(make_kernel(tmp_path / "c")))[0])
    edit(body)
    with pytest.raises(wire.WireError, match=reason):
        wire.parse_manifest(json.dumps(body).encode(), wire.KERNEL_ARTIFACT, wire.KERNEL_LIMITS)


# ---- round trips ---------------------------------------------------------------------------

def test_a_signed_kernel_entry_round_trips_into_a_fresh_cache(registry, keys, tmp_path):
    sign, public = keys["signer"][0], keys["signer"][1]
    source = make_kernel(tmp_path / "a")
    entry = only_entry(source)
    writer = remote(registry.address, "team/kernels", sign=sign)
    writer.queue_kernel(entry)
    writer.flush()
    assert writer.pushed == [f"kernel-{entry.key}"] and not writer.refused

    fresh = KernelStore(CacheLayout(tmp_path / "b"))
    reader = remote(registry.address, "team/kernels", public=public)
    with fresh.lock(entry.key):
        got = reader.fetch_kernel(fresh, wanted(entry))
    assert got is not None and fresh.get(entry.key) is not None
    assert got.sha256 == entry.sha256 and got.wheel.read_bytes() == entry.wheel.read_bytes()
    assert got.meta["fetched_from"] == f"{registry.address}/team/kernels"
    assert got.meta["fetched_signature"] == f"verified {signing.key_id(public)}"
    record = reader.record()
    assert record["hits"] == 1 and record["bytes_pulled"] >= entry.wheel.stat().st_size
    assert record["trust"] == f"signed by {signing.key_id(public)}" and not reader.test_log.warnings()
    assert leftovers(tmp_path / "b") == []

    # pushing again leaves the valid entry alone
    again = remote(registry.address, "team/kernels", sign=sign)
    again.queue_kernel(entry)
    again.flush()
    assert again.pushed == [] and again.already_there == [f"kernel-{entry.key}"]
    assert again.client.bytes_pushed == 0


def test_the_kernel_stage_takes_a_registry_hit_and_compiles_nothing(registry, keys, tmp_path, monkeypatch):
    """provide_kernels asks the remote cache between the local cache and a compile, with each
    kernel's own inputs from the plan."""
    from build import kernels as kernel_stage

    plan = load_plan(REPO_ROOT / "images" / "kernel-smoke")
    source = KernelStore(CacheLayout(tmp_path / "a"))
    writer = remote(registry.address, "team/stage", sign=keys["signer"][0])
    for kernel in plan.kernels:
        writer.queue_kernel(kernel_wheels.publish(source, kernel.key_inputs))
    writer.flush()

    monkeypatch.setattr(kernel_stage, "compile_kernel", lambda *a, **k: pytest.fail("compiled on a hit"))
    reader = remote(registry.address, "team/stage", public=keys["signer"][1])
    provided = kernel_stage.provide_kernels(plan, cache=CacheLayout(tmp_path / "b"), engine=None,
                                            log=EventLog(quiet=True),
                                            builder_base=lambda: pytest.fail("builder base made on a hit"),
                                            remote=reader.fetch_kernel)
    assert provided.states == {k.name: "hit registry" for k in plan.kernels}
    assert sorted(w.sha256 for w in provided.wheels) == sorted(e.sha256 for e in source.entries())
    assert not reader.test_log.warnings()


def test_a_layer_round_trips_rehashed_by_digest_and_diffid(registry, keys, tmp_path):
    _, layer = make_layer(tmp_path / "a")
    writer = remote(registry.address, "team/layers", sign=keys["signer"][0])
    writer.queue_layer(layer)
    writer.flush()
    assert writer.pushed == [f"layer-{layer.key}"]

    reader = remote(registry.address, "team/layers", public=keys["signer"][1])
    fresh = LayerCache(tmp_path / "b", remote=reader.fetch_layer)
    got = fresh.find(layer.key)
    assert got is not None and got.source == "registry" and layer_state(got) == "hit registry"
    assert (got.diff_id, got.digest, got.size) == (layer.diff_id, layer.digest, layer.size)
    assert got.path.read_bytes() == layer.path.read_bytes()
    assert fresh.lookup(layer.key) is None      # its diffID is checked in the background first
    assert fresh.settle() == {}
    assert layer_state(fresh.find(layer.key)) == "hit local"     # now the local cache has it
    assert leftovers(tmp_path / "b") == [] and reader.record()["hits"] == 1


def test_a_layer_whose_tar_is_not_its_diff_id_is_never_published(registry, keys, tmp_path):
    """layer.json names another diffID than its blob's tar (a signed entry can still be wrong):
    the check that runs while the engine loads the image refuses it, and nothing is published."""
    from build.remote_cache.layer_entries import layer_manifest

    _, layer = make_layer(tmp_path / "a", b"other tar\n")
    meta_path = layer.path.parent / "layer.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "diff_id": "sha256:" + "7" * 64}))
    manifest, blobs = layer_manifest(layer)
    _push_raw(registry.address, "team/wrongtar", f"layer-{layer.key}", manifest,
              [layer.path.read_bytes(), blobs[1][1]], keys["signer"][0])
    reader = remote(registry.address, "team/wrongtar", public=keys["signer"][1])
    fresh = LayerCache(tmp_path / "b", remote=reader.fetch_layer)
    assert fresh.find(layer.key) is not None                 # downloaded, its digest checked
    refused = fresh.settle()
    assert list(refused) == [layer.key] and "diffID" in refused[layer.key]
    assert fresh.lookup(layer.key) is None and leftovers(tmp_path / "b") == []


def test_a_layer_blob_the_image_push_stored_is_mounted_not_sent_again(registry, keys, tmp_path):
    _, layer = make_layer(tmp_path / "a", b"mounted\n")
    image_repo = CacheRegistry(registry.address, timeout=10)
    assert image_repo.push_file("team/image", layer.path, layer.digest, layer.size) == "uploaded"
    writer = remote(registry.address, "team/mountcache", sign=keys["signer"][0])
    writer.queue_layer(layer)
    writer.flush(mount_from="team/image")
    assert writer.pushed == [f"layer-{layer.key}"]
    layer_json = (layer.path.parent / "layer.json").stat().st_size
    assert writer.client.blobs_mounted == 1 and writer.client.bytes_pushed == layer_json + 2   # layer.json, {}
    assert writer.client.push_file("team/mountcache", layer.path, layer.digest, layer.size) == "present"


# ---- bad entries: one WARN each, a local rebuild, nothing half-written -----------------------

def _push_raw(address: str, repo: str, tag: str, manifest: bytes, blobs: list[bytes], key=None) -> None:
    client = CacheRegistry(address, timeout=10)
    for blob in [wire.EMPTY_BLOB, *blobs]:
        client.push_bytes(repo, blob)
    if key is not None:
        sign_entry(client, repo, f"{address}/{repo}", "sha256:" + hashlib.sha256(manifest).hexdigest(), key)
    client.put_manifest(repo, tag, manifest)


def _kernel_entry_bytes(entry, *, wheel: bytes | None = None, meta: dict | None = None):
    wheel = entry.wheel.read_bytes() if wheel is None else wheel
    meta_bytes = json.dumps(meta if meta is not None else entry.meta).encode()
    layers = [wire.Descriptor.of(wire.WHEEL_MEDIA, wheel, {wire.TITLE: entry.meta["wheel"]}),
              wire.Descriptor.of(wire.KERNEL_META_MEDIA, meta_bytes)]
    return wire.build_manifest(wire.KERNEL_ARTIFACT, layers), [wheel, meta_bytes]


def _refused(registry, keys, tmp_path, repo, entry, why):
    reader = remote(registry.address, repo, public=keys["signer"][1])
    fresh = KernelStore(CacheLayout(tmp_path / "fresh"))
    with fresh.lock(entry.key):
        assert reader.fetch_kernel(fresh, wanted(entry)) is None
    (line,) = reader.test_log.warnings()
    assert f"kernel-{entry.key}" in line and why in line and "compiling it here instead" in line
    assert fresh.get(entry.key) is None and fresh.states() == [] and leftovers(tmp_path / "fresh") == []
    return reader


def test_a_wheel_that_is_not_its_keys_is_refused(registry, keys, tmp_path):
    entry = only_entry(make_kernel(tmp_path / "a"))
    other = make_kernel(tmp_path / "other", payload=b"another build")
    manifest, blobs = _kernel_entry_bytes(entry, wheel=only_entry(other).wheel.read_bytes())
    _push_raw(registry.address, "team/badwheel", f"kernel-{entry.key}", manifest, blobs, keys["signer"][0])
    _refused(registry, keys, tmp_path, "team/badwheel", entry, "is not the wheel meta.json's sha256 names")


def test_a_replaced_wheel_with_its_sha256_updated_fails_the_rehash_of_its_inputs(registry, keys, tmp_path):
    entry = only_entry(make_kernel(tmp_path / "a"))
    wheel = only_entry(make_kernel(tmp_path / "o", payload=b"evil", version="1.7.1")).wheel.read_bytes()
    meta = {**entry.meta, "sha256": hashlib.sha256(wheel).hexdigest(), "inputs": {**entry.meta["inputs"], "x": 1}}
    manifest, blobs = _kernel_entry_bytes(entry, wheel=wheel, meta=meta)
    _push_raw(registry.address, "team/badinputs", f"kernel-{entry.key}", manifest, blobs, keys["signer"][0])
    _refused(registry, keys, tmp_path, "team/badinputs", entry, "recomputed from meta.json's inputs")


def test_a_meta_json_naming_another_key_is_refused(registry, keys, tmp_path):
    entry = only_entry(make_kernel(tmp_path / "a"))
    manifest, blobs = _kernel_entry_bytes(entry, meta={**entry.meta, "key": "f" * 64})
    _push_raw(registry.address, "team/otherkey", f"kernel-{entry.key}", manifest, blobs, keys["signer"][0])
    _refused(registry, keys, tmp_path, "team/otherkey", entry, "meta.json names another key")


def test_a_manifest_pointing_at_a_missing_blob_is_refused_and_not_overwritten(registry, keys, tmp_path):
    entry = only_entry(make_kernel(tmp_path / "a"))
    writer = remote(registry.address, "team/missing", sign=keys["signer"][0])
    writer.queue_kernel(entry)
    writer.flush()
    answer = requests.delete(f"http://{registry.address}/v2/team/missing/blobs/sha256:{entry.sha256}", timeout=10)
    assert answer.status_code == 202, answer.text
    _refused(registry, keys, tmp_path, "team/missing", entry, "which the registry does not have")
    pusher = remote(registry.address, "team/missing", sign=keys["signer"][0])
    pusher.queue_kernel(entry)
    pusher.flush()
    assert pusher.pushed == [] and f"kernel-{entry.key}" in pusher.refused
    assert "not overwritten" in pusher.test_log.warnings()[0]


def test_another_signer_or_no_signature_is_refused_and_never_overwritten(registry, keys, tmp_path):
    entry = only_entry(make_kernel(tmp_path / "a"))
    tag = f"kernel-{entry.key}"
    foreign = remote(registry.address, "team/foreign", sign=keys["other"][0])
    foreign.queue_kernel(entry)
    foreign.flush()
    _refused(registry, keys, tmp_path / "1", "team/foreign", entry, "made by another key")
    before = CacheRegistry(registry.address, timeout=10).get_manifest("team/foreign", tag)
    ours = remote(registry.address, "team/foreign", sign=keys["signer"][0])
    ours.queue_kernel(entry)
    ours.flush()
    assert ours.pushed == [] and tag in ours.refused and "not overwritten" in ours.test_log.warnings()[0]
    assert CacheRegistry(registry.address, timeout=10).get_manifest("team/foreign", tag) == before

    unsigned = remote(registry.address, "team/unsigned", trust=True)
    unsigned.queue_kernel(entry)
    unsigned.flush()
    assert unsigned.pushed == [tag]
    _refused(registry, keys, tmp_path / "2", "team/unsigned", entry, "it is unsigned")


def test_a_tag_holding_another_artifact_type_is_refused(registry, keys, tmp_path):
    entry = only_entry(make_kernel(tmp_path / "a"))
    _, layer = make_layer(tmp_path / "l")
    from build.remote_cache.layer_entries import layer_manifest

    manifest, blobs = layer_manifest(layer)
    _push_raw(registry.address, "team/wrongtype", f"kernel-{entry.key}", manifest,
              [layer.path.read_bytes(), blobs[1][1]], keys["signer"][0])
    _refused(registry, keys, tmp_path, "team/wrongtype", entry, "artifact type")


def test_trust_unsigned_uses_an_unsigned_entry_and_says_so(registry, tmp_path):
    entry = only_entry(make_kernel(tmp_path / "a"))
    writer = remote(registry.address, "team/trust", trust=True)
    writer.queue_kernel(entry)
    writer.flush()
    reader = remote(registry.address, "team/trust", trust=True)
    fresh = KernelStore(CacheLayout(tmp_path / "b"))
    with fresh.lock(entry.key):
        got = reader.fetch_kernel(fresh, wanted(entry))
    assert got is not None and got.meta["fetched_signature"] == "none (--trust-unsigned-cache)"
    assert reader.record()["trust"] == "UNSIGNED (--trust-unsigned-cache)"
    assert "UNSIGNED, used on --trust-unsigned-cache" in reader.test_log.text
    # and without any trust option the registry is not read at all
    silent = remote(registry.address, "team/trust")
    with fresh.lock("e" * 64):
        assert silent.fetch_kernel(fresh, Expected("e" * 64, {})) is None
    assert silent.record()["read"] is False and silent.client.bytes_pulled == 0


# ---- registries that fail --------------------------------------------------------------------

class Counting(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []
    status = 500
    headers_out: dict[str, str] = {}

    def _answer(self):
        type(self).seen.append(f"{self.command} {self.path}")
        self.send_response(self.status)
        for name, value in self.headers_out.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"no")

    do_GET = do_HEAD = do_POST = do_PUT = _answer

    def log_message(self, *args):
        pass


def serve(handler) -> tuple[str, http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"127.0.0.1:{server.server_address[1]}", server


def test_a_registry_answering_500_is_one_warn_then_the_build_goes_on(tmp_path, keys):
    handler = type("Failing", (Counting,), {"seen": [], "status": 500})
    address, server = serve(handler)
    try:
        reader = remote(address, "team/x", public=keys["signer"][1], sign=keys["signer"][0])
        store = KernelStore(CacheLayout(tmp_path / "c"))
        for key in ("a" * 64, "b" * 64):
            with store.lock(key):
                assert reader.fetch_kernel(store, Expected(key, {})) is None
        assert reader.fetch_layer(LayerCache(tmp_path / "l"), "c" * 64) is None
        entry = only_entry(make_kernel(tmp_path / "k"))
        reader.queue_kernel(entry)
        reader.flush()
        (line,) = reader.test_log.warnings()
        assert "unavailable" in line and "HTTP 500" in line and "goes on without it" in line
        assert len(handler.seen) == 1 and reader.record()["unavailable"]
    finally:
        server.shutdown()


def test_a_registry_that_never_answers_costs_one_stated_timeout(tmp_path, keys):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def accept_and_say_nothing():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    try:
        reader = remote(f"127.0.0.1:{listener.getsockname()[1]}", "team/x", public=keys["signer"][1],
                        sign=keys["signer"][0], timeout=1.5)
        store = KernelStore(CacheLayout(tmp_path / "c"))
        started = time.monotonic()
        for key in ("a" * 64, "b" * 64, "c" * 64):
            with store.lock(key):
                assert reader.fetch_kernel(store, Expected(key, {})) is None
        assert reader.fetch_layer(LayerCache(tmp_path / "l"), "d" * 64) is None
        reader.queue_kernel(only_entry(make_kernel(tmp_path / "k")))
        reader.flush()
        elapsed = time.monotonic() - started
        assert elapsed < 1.5 + 1.5, elapsed     # one timeout of 1.5 s for the whole build, not one per entry
        (line,) = reader.test_log.warnings()
        assert "unavailable" in line and "timed out" in line.lower()
    finally:
        stop.set()
        for conn in accepted:
            conn.close()
        listener.close()


def test_a_bad_key_is_refused_before_any_request(tmp_path, keys):
    handler = type("Watching", (Counting,), {"seen": [], "status": 404})
    address, server = serve(handler)
    try:
        reader = remote(address, "team/x", public=keys["signer"][1])
        store = KernelStore(CacheLayout(tmp_path / "c"))
        assert reader.fetch_layer(LayerCache(tmp_path / "l"), "../../" + "a" * 58) is None
        assert reader.fetch_layer(LayerCache(tmp_path / "l"), "a" * 63 + "\x1b") is None
        assert reader.fetch_kernel(store, Expected("A" * 64, {})) is None
        assert handler.seen == [] and len(reader.test_log.warnings()) == 3
        assert all("not a cache key" in line for line in reader.test_log.warnings())
        assert "\x1b" not in reader.test_log.text
    finally:
        server.shutdown()


# ---- concurrency -----------------------------------------------------------------------------

def test_two_runners_pushing_one_key_at_once_leave_one_valid_signed_entry(registry, keys, tmp_path):
    first = only_entry(make_kernel(tmp_path / "a", payload=b"build on runner 1"))
    second = only_entry(make_kernel(tmp_path / "b", payload=b"build on runner 2"))   # same key, other bytes
    assert first.key == second.key and first.sha256 != second.sha256
    layers = [make_layer(tmp_path / f"l{i}", b"same layer\n")[1] for i in (1, 2)]
    runners = [remote(registry.address, "team/race", sign=keys["signer"][0]) for _ in range(2)]
    for runner, entry, layer in zip(runners, (first, second), layers, strict=True):
        runner.queue_kernel(entry)
        runner.queue_layer(layer)
    errors = []

    def push(runner):
        try:
            runner.flush()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(not r.refused and not r.unavailable for r in runners)
    reader = remote(registry.address, "team/race", public=keys["signer"][1])
    fresh = KernelStore(CacheLayout(tmp_path / "fresh"))
    with fresh.lock(first.key):
        got = reader.fetch_kernel(fresh, wanted(first))
    assert got is not None and got.sha256 in (first.sha256, second.sha256)
    fetched = LayerCache(tmp_path / "fl")
    assert reader.fetch_layer(fetched, layers[0].key) is not None and fetched.settle() == {}
    assert not reader.test_log.warnings()
    stored = CacheRegistry(registry.address, timeout=10).get_manifest("team/race", f"kernel-{first.key}")
    assert CacheRegistry(registry.address, timeout=10).get_manifest(
        "team/race", signature_tag("sha256:" + hashlib.sha256(stored).hexdigest())) is not None


# ---- credentials and the command line --------------------------------------------------------

def test_credentials_from_docker_login_never_reach_a_log_or_the_record(tmp_path, keys, monkeypatch):
    secret = "s3cr3t-Passw0rd"
    handler = type("Locked", (Counting,), {"seen": [], "status": 401,
                                           "headers_out": {"WWW-Authenticate": 'Basic realm="cache"'}})
    address, server = serve(handler)
    config = tmp_path / "docker"
    config.mkdir()
    auth = base64.b64encode(f"ci-bot:{secret}".encode()).decode()
    (config / "config.json").write_text(json.dumps({"auths": {address: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    try:
        reader = remote(address, "team/x", public=keys["signer"][1], sign=keys["signer"][0])
        store = KernelStore(CacheLayout(tmp_path / "c"))
        with store.lock("a" * 64):
            assert reader.fetch_kernel(store, Expected("a" * 64, {})) is None
        text = reader.test_log.text + json.dumps(reader.record())
        assert "HTTP 401" in text and secret not in text and auth not in text
        assert len(handler.seen) == 2      # anonymous, then once with the credentials
    finally:
        server.shutdown()
    proc = run_build_cli("images/smoke", "--plan", "--cache-registry", f"ci-bot:{secret}@{address}/team/x")
    assert proc.returncode == 2 and "carries credentials" in proc.stderr
    assert secret not in proc.stdout + proc.stderr


@pytest.mark.parametrize("value, says", [
    ("127.0.0.1:5000/../etc", "not a Docker repository path component"),
    ("127.0.0.1:5000/Team/cache", "uppercase"),
    ("127.0.0.1:5000/team/ca\x01che", "characters no Docker reference holds"),
    ("http://127.0.0.1:5000/team/cache", "URL scheme"),
    ("127.0.0.1:5000/team/cache:v1", "carries a tag"),
    ("team/cache", "names no registry"),
])
def test_a_bad_cache_registry_is_exit_2_before_any_work(value, says):
    proc = run_build_cli("images/smoke", "--plan", "--cache-registry", value)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--cache-registry" in proc.stderr and says in proc.stderr and "Traceback" not in proc.stderr


def test_the_environment_variable_is_checked_too_and_trust_needs_a_registry(tmp_path):
    proc = run_build_cli("images/smoke", "--plan", env={"FTIMAGE_CACHE_REGISTRY": "127.0.0.1:5000/UP"})
    assert proc.returncode == 2 and "FTIMAGE_CACHE_REGISTRY" in proc.stderr
    proc = run_build_cli("images/smoke", "--plan", "--trust-unsigned-cache")
    assert proc.returncode == 2 and "names no" not in proc.stderr and "--cache-registry" in proc.stderr
    proc = run_build_cli("images/smoke", "--plan", "--cache-registry", "127.0.0.1:5000/x", "--cache-timeout", "0")
    assert proc.returncode == 2 and "--cache-timeout" in proc.stderr


def test_plan_checks_meta_json_says_not_yet_checked_and_never_hit_registry(registry, keys, tmp_path):
    """--plan reads each entry's signed meta.json and checks it as a build does before the wheel
    download: a sound one is "in registry, not yet checked" (its wheel is checked when a build
    downloads it); one whose meta.json names another key is refused, as the build refuses it."""
    plan = load_plan(REPO_ROOT / "images" / "kernel-smoke")
    sound, other = plan.kernels
    from build.remote_cache.kernel_entries import kernel_manifest

    entry = kernel_wheels.publish(KernelStore(CacheLayout(tmp_path / "a")), sound.key_inputs)
    manifest, blobs = kernel_manifest(entry)
    for key in (sound.key, other.key):     # the same entry under its own key and under another's
        _push_raw(registry.address, "team/plan", f"kernel-{key}", manifest, [entry.wheel.read_bytes(), blobs[1][1]],
                  keys["signer"][0])
    proc = run_build_cli("images/kernel-smoke", "--plan", "--json", "--cache", str(tmp_path / "empty"),
                         "--cache-registry", f"{registry.address}/team/plan", "--cache-key", str(keys["signer"][3]))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    states = {k["name"]: k["cache"] for k in data["kernels"]}
    assert states[sound.name]["state"] == "in registry, not yet checked"
    assert states[sound.name]["expected_compile"].startswith("0s (download) once its wheel passes its checks, else ~")
    assert states[other.name]["state"] == "miss" and states[other.name]["detail"] == "miss (registry entry refused)"
    (warning,) = [line for line in proc.stderr.splitlines() if "WARN" in line]
    assert f"kernel-{other.key}" in warning and "meta.json names another key" in warning
    assert "hit registry" not in proc.stdout and "read (entries signed by" in data["remote_cache"]
    text = run_build_cli("images/smoke", "--plan", "--cache-registry", f"{registry.address}/team/plan")
    assert text.returncode == 0 and "NOT read (pass --cache-key PUB, or --trust-unsigned-cache)" in text.stdout
