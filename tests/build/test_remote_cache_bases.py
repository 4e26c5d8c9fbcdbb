"""Base and resolution entries of the remote cache, against a real registry (Debian's
docker-registry, no engine): a base entry round trips with base.json alone (its layer is fetched
only when asked for, digest and diffID checked); a resolution entry round trips with its time.
Then each way such an entry can be wrong is one WARN naming the entry and the normal path
(debootstrap, pip), with nothing half-written: another signer, contents that are not what
their key says, a layer cut off mid-pull, a base.json naming another deb lock."""
from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import socket
import tarfile
import threading
from pathlib import Path

import pytest
import requests

from build.oci.image import canonical, image_config, sha256_digest
from build.remote_cache import wire
from build.remote_cache.base_entries import BaseMeta, ExpectedBase, base_manifest
from build.remote_cache.resolution_entries import resolution_bytes
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.trust import sign_entry
from build.resolve import load_plan
from build.spec import REPO_ROOT
from build.wheelhouse import Wheel
from tests.build.test_remote_cache import remote

pytestmark = pytest.mark.unit

SPEC = "a" * 64
LOCK = "b" * 64
EXPECTED = ExpectedBase(name="debian-bookworm", spec_sha256=SPEC, debs_lock_sha256=LOCK)


def rootfs(folder: Path, text: bytes = b"root\n") -> tuple[Path, str]:
    """A tiny root filesystem layer, gzipped: (the blob, its diffID)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("etc/os-release")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    blob = folder / "rootfs.tar.gz"
    folder.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(gzip.compress(raw.getvalue(), mtime=0))
    return blob, sha256_digest(raw.getvalue())


def base_meta(folder: Path, *, lock: str = LOCK, diff_id: str | None = None) -> tuple[BaseMeta, Path]:
    blob, real_diff_id = rootfs(folder)
    diff_id = diff_id or real_diff_id
    config = image_config(diff_id, epoch=1752228997, env=["PATH=/usr/bin", "LANG=C.UTF-8"], cmd=["/bin/bash"],
                          labels={"io.ftimage.base.spec-sha256": SPEC, "io.ftimage.base.name": EXPECTED.name,
                                  "io.ftimage.base.rootfs": diff_id}, created_by="ftimage bootstrap-base")
    data = blob.read_bytes()
    meta = BaseMeta(name=EXPECTED.name, spec_sha256=SPEC, debs_lock_sha256=lock, config=config, diff_id=diff_id,
                    digest=sha256_digest(data), size=len(data), packages=())
    return meta, blob


def push_base(address: str, repo: str, meta: BaseMeta, blob: Path, key) -> None:
    manifest, blobs = base_manifest(meta, blob)
    client = CacheRegistry(address, timeout=10)
    client.push_bytes(repo, wire.EMPTY_BLOB)
    for descriptor, source in blobs:
        client.push_bytes(repo, source if isinstance(source, bytes) else source.read_bytes())
    sign_entry(client, repo, f"{address}/{repo}", sha256_digest(manifest), key)
    client.put_manifest(repo, f"base-{SPEC}", manifest)


def test_a_base_round_trips_with_base_json_alone_then_its_layer_on_demand(registry, keys, tmp_path):
    meta, blob = base_meta(tmp_path / "a")
    writer = remote(registry.address, "team/bases", sign=keys["signer"][0])
    writer.queue_base(SPEC, lambda folder: (meta, blob))
    writer.flush()
    assert writer.pushed == [f"base-{SPEC}"]

    reader = remote(registry.address, "team/bases", public=keys["signer"][1])
    found = reader.fetch_base(EXPECTED)
    assert found is not None and found.meta == meta and found.meta.image_id == sha256_digest(meta.config)
    assert reader.client.bytes_pulled < 8192                       # base.json, not the layer
    dest = tmp_path / "fetched.tar.gz"
    assert reader.fetch_base_layer(found, dest) and dest.read_bytes() == blob.read_bytes()
    assert reader.test_log.warnings() == []
    assert reader.base_state(EXPECTED) == ("in registry", meta.size)

    again = remote(registry.address, "team/bases", sign=keys["signer"][0])
    again.queue_base(SPEC, lambda folder: pytest.fail("the base is exported only when the registry lacks it"))
    again.flush()
    assert again.already_there == [f"base-{SPEC}"]


def _refused_base(registry, keys, repo: str, why: str) -> None:
    reader = remote(registry.address, repo, public=keys["signer"][1])
    assert reader.fetch_base(EXPECTED) is None
    (line,) = reader.test_log.warnings()
    assert f"base-{SPEC}" in line and why in line and "bootstrapping it here instead" in line


def test_a_base_entry_signed_by_another_key_is_refused(registry, keys, tmp_path):
    meta, blob = base_meta(tmp_path / "a")
    push_base(registry.address, "team/foreignbase", meta, blob, keys["other"][0])
    _refused_base(registry, keys, "team/foreignbase", "made by another key")


def test_a_base_json_naming_another_deb_lock_is_refused(registry, keys, tmp_path):
    meta, blob = base_meta(tmp_path / "a", lock="c" * 64)
    push_base(registry.address, "team/otherlock", meta, blob, keys["signer"][0])
    _refused_base(registry, keys, "team/otherlock", "names another deb lock")


def test_a_config_naming_another_root_filesystem_is_refused(registry, keys, tmp_path):
    meta, blob = base_meta(tmp_path / "a")
    forged = BaseMeta(**{**meta.__dict__, "config": image_config(
        "sha256:" + "d" * 64, epoch=1752228997, env=[], cmd=[], labels={}, created_by="x")})
    push_base(registry.address, "team/otherroot", forged, blob, keys["signer"][0])
    _refused_base(registry, keys, "team/otherroot", "root filesystem is not the layer base.json names")


def test_a_layer_whose_tar_is_not_its_diff_id_is_refused_when_fetched_and_nothing_is_left(registry, keys, tmp_path):
    meta, blob = base_meta(tmp_path / "a", diff_id="sha256:" + "e" * 64)    # signed, but not its own tar
    push_base(registry.address, "team/wrongtar", meta, blob, keys["signer"][0])
    reader = remote(registry.address, "team/wrongtar", public=keys["signer"][1])
    found = reader.fetch_base(EXPECTED)
    assert found is not None                      # base.json is self-consistent: the layer tells
    dest = tmp_path / "fetched.tar.gz"
    assert not reader.fetch_base_layer(found, dest) and not dest.exists()
    (line,) = reader.test_log.warnings()
    assert f"base-{SPEC}" in line and "diffID" in line and "bootstrapping it here instead" in line


class CutBlobs(http.server.BaseHTTPRequestHandler):
    """A proxy in front of the registry that sends half of every large blob, then hangs up."""
    upstream = ""

    def do_GET(self):  # noqa: N802 - the http.server API
        answer = requests.get(f"http://{self.upstream}{self.path}", headers={"Accept": self.headers.get("Accept", "")},
                              timeout=10)
        body = answer.content
        self.send_response(answer.status_code)
        for name in ("Content-Type", "Docker-Content-Digest"):
            if name in answer.headers:
                self.send_header(name, answer.headers[name])
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = "/blobs/" in self.path and len(body) > 200
        self.wfile.write(body[:len(body) // 2] if cut else body)
        if cut:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *args):
        pass


def test_a_layer_cut_off_mid_pull_is_refused_and_no_partial_file_is_left(registry, keys, tmp_path):
    meta, blob = base_meta(tmp_path / "a")
    blob.write_bytes(blob.read_bytes() + bytes(4096))            # big enough to be cut by the proxy
    meta = BaseMeta(**{**meta.__dict__, "digest": sha256_digest(blob.read_bytes()), "size": blob.stat().st_size})
    push_base(registry.address, "team/cut", meta, blob, keys["signer"][0])
    reader = remote(registry.address, "team/cut", public=keys["signer"][1])
    found = reader.fetch_base(EXPECTED)
    handler = type("Cut", (CutBlobs,), {"upstream": registry.address})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cut_reader = remote(f"127.0.0.1:{server.server_address[1]}", "team/cut", public=keys["signer"][1])
        dest = tmp_path / "fetched.tar.gz"
        assert not cut_reader.fetch_base_layer(found, dest) and not dest.exists()
    finally:
        server.shutdown()
    (line,) = cut_reader.test_log.warnings()
    assert f"base-{SPEC}" in line and "did not arrive whole" in line and "bootstrapping it here instead" in line


# ---- the resolution ------------------------------------------------------------------------

def closure():
    plan = load_plan(REPO_ROOT / "images" / "smoke")
    torch = Wheel(name="torch", version=plan.toolchain.torch_version, filename=plan.torch_wheel.filename,
                  sha256=plan.torch_wheel.sha256, size=123)
    other = Wheel(name="pyyaml", version="6.0.3", filename="PyYAML-6.0.3-cp311-cp311-manylinux_2_17_x86_64.whl",
                  sha256="f" * 64, size=456)
    return plan, (other, torch)


def read_back_resolution(registry, keys, signer: str, repo: str):
    """A resolution pushed signed by `signer`, read back by a runner trusting "signer"."""
    plan, wheels = closure()
    key = hashlib.sha256(repo.encode()).hexdigest()
    writer = remote(registry.address, repo, sign=keys[signer][0])
    writer.queue_resolution(key, wheels, 1700000123)
    writer.flush()
    reader = remote(registry.address, repo, public=keys["signer"][1])
    return reader, reader.fetch_resolution(key, plan), key, plan, wheels


def test_a_resolution_round_trips_with_its_wheels_time(registry, keys):
    reader, found, key, plan, wheels = read_back_resolution(registry, keys, "signer", "team/res")
    assert found == (wheels, 1700000123)
    assert reader.resolution_state(key, plan) == "in registry"
    assert reader.test_log.warnings() == []


@pytest.mark.parametrize(("edit", "why"), [
    (lambda doc: {**doc, "key": "0" * 64}, "is the closure of key"),
    (lambda doc: {**doc, "wheels": doc["wheels"][:1]}, "edited or truncated"),
    (lambda doc: {**doc, "wheels_epoch": "yesterday"}, "wheels_epoch is not a time"),
])
def test_a_resolution_that_is_not_its_keys_is_refused(registry, keys, edit, why):
    plan, wheels = closure()
    key = hashlib.sha256(why.encode()).hexdigest()
    raw = canonical(edit(json.loads(resolution_bytes(key, wheels, 1700000123))))
    manifest = wire.build_manifest(wire.RESOLUTION_ARTIFACT, [wire.Descriptor.of(wire.RESOLUTION_MEDIA, raw)])
    client = CacheRegistry(registry.address, timeout=10)
    for data in (wire.EMPTY_BLOB, raw):
        client.push_bytes("team/badres", data)
    sign_entry(client, "team/badres", f"{registry.address}/team/badres", sha256_digest(manifest), keys["signer"][0])
    client.put_manifest("team/badres", f"resolution-{key}", manifest)
    reader = remote(registry.address, "team/badres", public=keys["signer"][1])
    assert reader.fetch_resolution(key, plan) is None
    (line,) = reader.test_log.warnings()
    assert f"resolution-{key}" in line and why in line and "resolving it with pip instead" in line


def test_a_resolution_signed_by_another_key_is_refused(registry, keys):
    reader, found, key, _, _ = read_back_resolution(registry, keys, "other", "team/foreignres")
    assert found is None
    (line,) = reader.test_log.warnings()
    assert f"resolution-{key}" in line and "made by another key" in line


# ---- the bases of a build (build/base/provide.py), with a fake engine ---------------------

def registry_entry_for(ref, folder: Path, *, diff_id: str | None = None) -> tuple[BaseMeta, Path]:
    """A base entry for the real spec of `ref` (its spec digest, name and deb lock)."""
    from build.base.provide import expected_base

    expected = expected_base(ref)
    blob, real = rootfs(folder)
    diff_id = diff_id or real
    config = image_config(diff_id, epoch=1752228997, env=["PATH=/usr/bin", "LANG=C.UTF-8"], cmd=["/bin/bash"],
                          labels={"io.ftimage.base.spec-sha256": expected.spec_sha256,
                                  "io.ftimage.base.name": expected.name, "io.ftimage.base.rootfs": diff_id},
                          created_by="ftimage bootstrap-base")
    from build.context.dpkg_status import DebPackage

    data = blob.read_bytes()
    return BaseMeta(name=expected.name, spec_sha256=expected.spec_sha256,
                    debs_lock_sha256=expected.debs_lock_sha256, config=config, diff_id=diff_id,
                    digest=sha256_digest(data), size=len(data),
                    packages=(DebPackage("bash", "5.2.15-2+b13", "amd64"),)), blob


def test_a_build_reads_a_registry_base_without_loading_it_and_loads_it_only_when_asked(registry, keys, tmp_path,
                                                                                      monkeypatch):
    from build.base import provide
    from build.cache import CacheLayout
    from contracts.events import EventLog
    from tests.fakes.engine import FakeEngine

    plan = load_plan(REPO_ROOT / "images" / "smoke")
    writer = remote(registry.address, "team/provide", sign=keys["signer"][0])
    metas = {}
    for stage, ref in (("builder", plan.spec.builder_base), ("runtime", plan.spec.runtime_base)):
        meta, blob = registry_entry_for(ref, tmp_path / stage)
        metas[stage] = meta
        writer.queue_base(meta.spec_sha256, lambda folder, m=meta, b=blob: (m, b))
    writer.flush()
    monkeypatch.setattr(provide, "bootstrap", lambda *a, **k: pytest.fail("nothing may be bootstrapped"))
    monkeypatch.setattr(provide, "ensure_base", lambda *a, **k: pytest.fail("nothing may be bootstrapped"))
    engine = FakeEngine()
    reader = remote(registry.address, "team/provide", public=keys["signer"][1])
    bases = provide.Bases(plan, engine, CacheLayout(tmp_path / "cache"), EventLog(stream=io.StringIO()), reader)
    found = bases.find()
    assert {stage: base.id for stage, base in found.items()} == {s: m.image_id for s, m in metas.items()}
    assert engine.count("load_stream") == 0 and bases.states["runtime"].startswith("hit registry (base.json only")
    info = bases.info("runtime")
    assert info["RootFS"]["Layers"] == [metas["runtime"].diff_id] and info["Created"] == "2025-07-11T10:16:37Z"
    assert bases.packages("runtime")[0].name == "bash"

    ref = bases.loaded("runtime")                   # a stage needs it in the engine
    assert engine.count("load_stream") == 1 and engine.images[ref]["Id"] == metas["runtime"].image_id
    assert bases.states["runtime"] == "hit registry (loaded)" and bases.states["builder"].startswith("hit registry")
    assert reader.test_log.warnings() == []


def test_a_registry_base_whose_layer_is_refused_is_bootstrapped_instead(registry, keys, tmp_path, monkeypatch):
    from build.base import provide
    from build.base.bootstrap import BaseImage
    from build.cache import CacheLayout
    from contracts.events import EventLog
    from tests.fakes.engine import FakeEngine

    plan = load_plan(REPO_ROOT / "images" / "smoke")
    ref = plan.spec.runtime_base
    meta, blob = registry_entry_for(ref, tmp_path / "r", diff_id="sha256:" + "9" * 64)   # not its tar
    writer = remote(registry.address, "team/refusedbase", sign=keys["signer"][0])
    writer.queue_base(meta.spec_sha256, lambda folder: (meta, blob))
    writer.flush()
    bootstrapped = []
    monkeypatch.setattr(provide, "bootstrap", lambda base, *a: bootstrapped.append(base.name) or
                        BaseImage(ref="ftimage-base/x:1", id="sha256:" + "1" * 64, reused=False))
    monkeypatch.setattr(provide, "ensure_base", lambda *a, **k: BaseImage(ref="b:1", id="sha256:" + "2" * 64,
                                                                          reused=True))
    reader = remote(registry.address, "team/refusedbase", public=keys["signer"][1])
    bases = provide.Bases(plan, FakeEngine(), CacheLayout(tmp_path / "cache"), EventLog(stream=io.StringIO()),
                          reader)
    bases.find()
    assert bases.loaded("runtime") == "ftimage-base/x:1" and bootstrapped == [ref.bootstrap.name]
    assert bases.states["runtime"].startswith("miss (bootstrapped")
    (line,) = reader.test_log.warnings()
    assert f"base-{meta.spec_sha256}" in line and "diffID" in line
