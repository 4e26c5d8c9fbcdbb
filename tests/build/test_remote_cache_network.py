"""The remote cache's registry client when the network or the registry misbehaves: a server that
trickles its headers or its body, or hangs after its headers, is cut at the stated timeout (a
wall-clock bound, not a wait per byte), and the build-wide budget ends the cache once spent;
every network error reaches the caller as the registry error type; a missing or altered
signature blob refuses that entry only; a token service answering nonsense makes the registry
unavailable; an HTTPS registry never gets a login sent to a plain-HTTP token service; a layer
entry whose layer.json says another name, history line or time than the build makes is refused
and never overwritten; `flush` never fails a build; and an error answer's body is never echoed
with a credential in it."""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import socket
import threading
import time

import pytest
import requests
import urllib3

from build.cache import CacheLayout
from build.kernels.acceptance import Expected
from build.kernels.store import KernelStore
from build.oci.layercache import LayerCache
from build.oci.tarlayer import TreeEntry, write_layer
from build.publish.registry import ContentError, Registry, RegistryError
from build.remote_cache import RemoteCache
from build.remote_cache.options import RemoteCacheOptions
from build.remote_cache.transport import CacheRegistry
from build.remote_cache.trust import signature_tag
from contracts.redact import quote
from tests.build.test_remote_cache import Log, make_kernel, make_layer, only_entry, remote, wanted

pytestmark = pytest.mark.unit
MARGIN = 2.5      # seconds a cut request may take past its timeout (thread wake-ups on a loaded 2-core box)


# ---- servers that misbehave, on 127.0.0.1, bounded and self-stopping --------------------------

class Trickler:
    """Answers every connection with a status line and headers, then: "body": a body of 64 KiB
    sent a byte every `pace` seconds; "head": the headers themselves a byte at a time, never
    finished; "hang": nothing after the headers. Every connection is closed after `lifetime`
    seconds, and `close` stops it all."""

    def __init__(self, mode: str, pace: float = 0.05, lifetime: float = 20.0):
        self.mode, self.pace, self.lifetime = mode, pace, lifetime
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        self.connections = 0
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        ends = time.monotonic() + self.lifetime
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\n"
                b"Content-Length: 65536\r\n\r\n")
        try:
            conn.settimeout(1.0)
            conn.recv(65536)              # the request (its first packet is enough here)
            if self.mode != "head":
                conn.sendall(head)
            to_send = head if self.mode == "head" else b"{" * 65536 if self.mode == "body" else b""
            for i in range(len(to_send)):
                if self.stop.is_set() or time.monotonic() > ends:
                    break
                conn.sendall(to_send[i:i + 1])
                time.sleep(self.pace)
            while not self.stop.is_set() and time.monotonic() < ends:   # "hang": hold it open, silent
                time.sleep(0.05)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=5)
        self.listener.close()


@pytest.fixture
def trickler(request):
    server = Trickler(request.param)
    yield server
    server.close()


def serve(handler) -> tuple[str, http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"127.0.0.1:{server.server_address[1]}", server


class Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# ---- a wall-clock bound on every request ------------------------------------------------------

@pytest.mark.parametrize("trickler", ["body", "head", "hang"], indirect=True)
def test_a_trickling_or_hanging_registry_is_cut_at_the_stated_timeout_with_one_warn(trickler, tmp_path, keys):
    reader = remote(trickler.address, "team/x", public=keys["signer"][1], sign=keys["signer"][0], timeout=1.0)
    store = KernelStore(CacheLayout(tmp_path / "c"))
    started = time.monotonic()
    with store.lock("a" * 64):
        assert reader.fetch_kernel(store, Expected("a" * 64, {})) is None
    first = time.monotonic() - started
    assert first < 1.0 + MARGIN, first        # the trickle would have taken an hour
    for key in ("b" * 64, "c" * 64):           # then no more requests: the cache is unavailable
        with store.lock(key):
            assert reader.fetch_kernel(store, Expected(key, {})) is None
    reader.queue_kernel(only_entry(make_kernel(tmp_path / "k")))
    reader.flush()
    assert time.monotonic() - started < 1.0 + MARGIN
    (line,) = reader.test_log.warnings()
    assert "unavailable" in line and "timed out" in line and "goes on without it" in line
    assert trickler.connections == 1 and store.entries() == []


@pytest.mark.parametrize("trickler", ["body", "head", "hang"], indirect=True)
def test_the_image_registry_client_has_the_same_bound(trickler):
    client = Registry(trickler.address, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(RegistryError, match="timed out"):
        client.manifest("team/x", "latest")
    assert time.monotonic() - started < 1.0 + MARGIN


def test_the_build_wide_budget_ends_the_cache_with_one_warn(tmp_path, keys):
    class Slow(Quiet):
        def do_GET(self):
            time.sleep(0.4)
            self.reply(404)

    address, server = serve(Slow)
    try:
        log = Log()
        options = RemoteCacheOptions(registry=address, path="team/x", timeout=1.0, public_key=keys["signer"][1])
        reader = RemoteCache(options, log.log, client=CacheRegistry(address, timeout=1.0, budget=1.0))
        store = KernelStore(CacheLayout(tmp_path / "c"))
        started = time.monotonic()
        for key in ("1" * 64, "2" * 64, "3" * 64, "4" * 64, "5" * 64, "6" * 64):
            with store.lock(key):
                assert reader.fetch_kernel(store, Expected(key, {})) is None
        assert time.monotonic() - started < 1.0 + MARGIN
        (line,) = log.warnings()
        assert "unavailable" in line and "registry time budget" in line
        assert reader.record()["registry_s"] <= 1.0 + 0.5
    finally:
        server.shutdown()


def test_cache_timeout_help_and_the_plan_state_the_budget():
    from build.remote_cache.options import BUDGET_TIMEOUTS

    options = RemoteCacheOptions(registry="127.0.0.1:5000", path="team/x", timeout=20.0)
    assert options.budget == 20.0 * BUDGET_TIMEOUTS and "600s per build" in options.describe()
    import argparse

    from build.remote_cache.options import add_options

    parser = argparse.ArgumentParser()
    add_options(parser)
    assert f"{BUDGET_TIMEOUTS} times this" in " ".join(parser.format_help().split())


# ---- network errors are registry errors -------------------------------------------------------

class Truncating(Quiet):
    """Says 100 bytes and sends 10, then closes: urllib3's IncompleteRead/ProtocolError."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        self.wfile.write(b"0123456789")
        self.wfile.flush()
        self.close_connection = True


def test_a_connection_lost_mid_body_is_a_registry_error_from_every_read():
    address, server = serve(Truncating)
    try:
        client = Registry(address, timeout=5)
        for read in (lambda: client.manifest("team/x", "latest"), lambda: client.blob("team/x", "sha256:" + "a" * 64)):
            with pytest.raises(RegistryError, match="lost"):
                read()
        cache_client = CacheRegistry(address, timeout=5)
        with pytest.raises(RegistryError):
            cache_client.get_manifest("team/x", "kernel-" + "a" * 64)
    finally:
        server.shutdown()


@pytest.mark.parametrize("error", [
    urllib3.exceptions.ReadTimeoutError(None, "/v2/", "Read timed out."),
    urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")),
    ConnectionResetError(104, "Connection reset by peer"),
])
def test_urllib3_and_socket_errors_never_escape_the_client(monkeypatch, error):
    client = CacheRegistry("127.0.0.1:9", timeout=5)

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(client.session, "request", broken)
    for call in (lambda: client.manifest("team/x", "latest"), lambda: client.has_blob("team/x", "sha256:" + "a" * 64),
                 lambda: client.get_manifest("team/x", "kernel-" + "a" * 64),
                 lambda: client.put_manifest("team/x", "t", b"{}")):
        with pytest.raises(RegistryError):
            call()


def test_a_signature_read_that_breaks_mid_body_makes_the_cache_unavailable_not_a_crash(registry, keys, tmp_path,
                                                                                      monkeypatch):
    entry = only_entry(make_kernel(tmp_path / "a"))
    writer = remote(registry.address, "team/sigbreak", sign=keys["signer"][0])
    writer.queue_kernel(entry)
    writer.flush()
    reader = remote(registry.address, "team/sigbreak", public=keys["signer"][1])
    real = reader.client.session.request

    def flaky(method, url, **kwargs):
        answer = real(method, url, **kwargs)
        if "/manifests/sha256-" in url and method == "GET":    # the signature's manifest
            def broken(*a, **k):
                raise urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead(10 bytes read)")
            answer.raw.read = broken
        return answer

    monkeypatch.setattr(reader.client.session, "request", flaky)
    store = KernelStore(CacheLayout(tmp_path / "b"))
    with store.lock(entry.key):
        assert reader.fetch_kernel(store, wanted(entry)) is None
    (line,) = reader.test_log.warnings()
    assert "unavailable" in line and "IncompleteRead" in line and reader.unavailable
    assert f"while reading entry kernel-{entry.key}" in line      # the entry cut off mid-pull is named


def _signed_kernels(registry, keys, tmp_path, repo):
    first = only_entry(make_kernel(tmp_path / "a"))
    second = only_entry(make_kernel(tmp_path / "b", version="1.8.0"))
    writer = remote(registry.address, repo, sign=keys["signer"][0])
    for entry in (first, second):
        writer.queue_kernel(entry)
    writer.flush()
    assert len(writer.pushed) == 2
    return first, second


def _signature_payload_digest(registry, repo: str, key: str) -> str:
    client = CacheRegistry(registry.address, timeout=10)
    manifest = client.get_manifest(repo, f"kernel-{key}")
    signature = client.get_manifest(repo, signature_tag("sha256:" + hashlib.sha256(manifest).hexdigest()))
    return json.loads(signature)["layers"][0]["digest"]


def test_a_missing_signature_blob_refuses_that_entry_only(registry, keys, tmp_path):
    first, second = _signed_kernels(registry, keys, tmp_path, "team/sigmissing")
    payload = _signature_payload_digest(registry, "team/sigmissing", first.key)
    answer = requests.delete(f"http://{registry.address}/v2/team/sigmissing/blobs/{payload}", timeout=10)
    assert answer.status_code == 202, answer.text
    reader = remote(registry.address, "team/sigmissing", public=keys["signer"][1])
    store = KernelStore(CacheLayout(tmp_path / "fresh"))
    with store.lock(first.key):
        assert reader.fetch_kernel(store, wanted(first)) is None
    with store.lock(second.key):
        assert reader.fetch_kernel(store, wanted(second)) is not None     # the cache is still in use
    (line,) = reader.test_log.warnings()
    assert f"kernel-{first.key}" in line and "refused" in line and "signature" in line
    assert not reader.unavailable and reader.record()["hits"] == 1


def test_an_altered_signature_blob_refuses_that_entry_only(registry, keys, tmp_path, monkeypatch):
    first, second = _signed_kernels(registry, keys, tmp_path, "team/sigaltered")
    payload = _signature_payload_digest(registry, "team/sigaltered", first.key)
    reader = remote(registry.address, "team/sigaltered", public=keys["signer"][1])
    real = reader.client.session.request

    def altering(method, url, **kwargs):
        answer = real(method, url, **kwargs)
        if url.endswith(f"/blobs/{payload}"):
            answer.raw = urllib3.response.HTTPResponse(body=io.BytesIO(b'{"other": "payload"}'),
                                                       preload_content=False, status=200)
        return answer

    monkeypatch.setattr(reader.client.session, "request", altering)
    store = KernelStore(CacheLayout(tmp_path / "fresh"))
    with store.lock(first.key):
        assert reader.fetch_kernel(store, wanted(first)) is None
    with store.lock(second.key):
        assert reader.fetch_kernel(store, wanted(second)) is not None
    (line,) = reader.test_log.warnings()
    assert f"kernel-{first.key}" in line and "other content" in line and not reader.unavailable


def test_a_missing_blob_is_a_content_error_for_verify_image_too(registry):
    with pytest.raises(ContentError, match="has no blob"):
        Registry(registry.address).blob("team/none", "sha256:" + "e" * 64)


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"token": 5}', b'{"token": "two words"}', b"{}"])
def test_a_token_service_answering_nonsense_makes_the_registry_unavailable(tmp_path, keys, body):
    class Tokens(Quiet):
        def do_GET(self):
            if self.path.startswith("/token"):
                self.reply(200, body)
            else:
                port = self.server.server_address[1]
                self.reply(401, b"", {"WWW-Authenticate": f'Bearer realm="http://127.0.0.1:{port}/token",'
                                                          'service="cache",scope="repository:team/x:pull"'})

    address, server = serve(Tokens)
    try:
        reader = remote(address, "team/x", public=keys["signer"][1])
        store = KernelStore(CacheLayout(tmp_path / "c"))
        for key in ("a" * 64, "b" * 64):
            with store.lock(key):
                assert reader.fetch_kernel(store, Expected(key, {})) is None
        (line,) = reader.test_log.warnings()
        assert "unavailable" in line and "without a usable token" in line
    finally:
        server.shutdown()


# ---- flush never fails a build ----------------------------------------------------------------

def test_flush_skips_an_entry_it_cannot_read_and_pushes_the_rest(registry, keys, tmp_path):
    gone = only_entry(make_kernel(tmp_path / "a"))
    kept = only_entry(make_kernel(tmp_path / "b", version="1.8.0"))
    gone.wheel.unlink()
    writer = remote(registry.address, "team/flushgone", sign=keys["signer"][0])
    writer.queue_kernel(gone)
    writer.queue_kernel(kept)
    writer.flush()
    assert writer.pushed == [f"kernel-{kept.key}"] and not writer.unavailable
    (line,) = writer.test_log.warnings()
    assert gone.key in line and "not pushed" in line


def test_flush_after_a_network_error_warns_once_and_returns(registry, keys, tmp_path, monkeypatch):
    writer = remote(registry.address, "team/flushnet", sign=keys["signer"][0])

    def broken(*args, **kwargs):
        raise urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))

    monkeypatch.setattr(writer.client.session, "request", broken)
    writer.queue_kernel(only_entry(make_kernel(tmp_path / "a")))
    writer.queue_layer(make_layer(tmp_path / "l")[1])
    writer.flush()
    (line,) = writer.test_log.warnings()
    assert "unavailable" in line and writer.pushed == []


# ---- a layer entry must be the layer this build makes ----------------------------------------

@pytest.mark.parametrize("field, forged", [("created_by", "ftimage app: something else entirely"),
                                           ("mtime", 1600000000), ("name", "venv")])
def test_a_layer_entry_with_another_history_is_refused_rebuilt_and_not_overwritten(registry, keys, tmp_path,
                                                                                    field, forged):
    repo = f"team/layermeta-{field.replace('_', '')}"
    text = f"print('{field}')\n".encode()
    entries = [TreeEntry("opt", "dir", mode=0o755), TreeEntry("opt/app.py", "file", data=text)]
    expected = {"name": "app", "created_by": "ftimage app", "mtime": 1700000000}
    key = hashlib.sha256(text).hexdigest()
    forged_meta = {**expected, field: forged}
    source = LayerCache(tmp_path / "a")
    layer = source.get_or_make(key, forged_meta["name"], forged_meta["created_by"], forged_meta["mtime"],
                               lambda path: write_layer(path, entries, 1700000000))
    writer = remote(registry.address, repo, sign=keys["signer"][0])
    writer.queue_layer(layer)
    writer.flush()
    before = CacheRegistry(registry.address, timeout=10).get_manifest(repo, f"layer-{key}")

    reader = remote(registry.address, repo, public=keys["signer"][1], sign=keys["signer"][0])
    made = []

    def make(path):
        made.append(path)
        return write_layer(path, entries, 1700000000)

    fresh = LayerCache(tmp_path / "b", remote=reader.fetch_layer)
    got = fresh.get_or_make(key, expected["name"], expected["created_by"], expected["mtime"], make)
    assert made and got.source == "local" and not got.reused
    assert (got.name, got.created_by, got.mtime) == (expected["name"], expected["created_by"], expected["mtime"])
    (line,) = reader.test_log.warnings()
    assert f"layer-{key}" in line and f"layer.json's {field}" in line and "assembling it here instead" in line
    reader.queue_layer(got)
    reader.flush()
    assert reader.pushed == [] and reader.already_there == []
    assert CacheRegistry(registry.address, timeout=10).get_manifest(repo, f"layer-{key}") == before


def test_a_layer_entry_with_the_expected_history_is_used(registry, keys, tmp_path):
    _, layer = make_layer(tmp_path / "a", b"expected\n")
    writer = remote(registry.address, "team/layermeta-ok", sign=keys["signer"][0])
    writer.queue_layer(layer)
    writer.flush()
    reader = remote(registry.address, "team/layermeta-ok", public=keys["signer"][1])
    fresh = LayerCache(tmp_path / "b", remote=reader.fetch_layer)
    got = fresh.get_or_make(layer.key, "app", "ftimage app", 1700000000, lambda path: pytest.fail("rebuilt"))
    assert got.source == "registry" and not reader.test_log.warnings()


# ---- what an error answer may say -------------------------------------------------------------

SECRET = "eyJhbGciOiJIUzI1NiJ9.c2VjcmV0LXBheWxvYWQ.sig-part-here"


@pytest.mark.parametrize("body", [
    f'{{"errors":[{{"code":"DENIED","message":"denied"}}],"token":"{SECRET}"}}',
    f"upstream said: Authorization: Bearer {SECRET}",
    f"basic auth failed for ci-bot:{SECRET}",
    f"password={SECRET}",
    f"here is a key {SECRET}",
    "x" * 5000 + SECRET,
])
def test_an_error_body_is_quoted_short_and_without_credentials(body):
    text = quote(body.encode())
    assert SECRET not in text and "c2VjcmV0" not in text and "sig-part-here" not in text
    assert len(text) <= 130


def test_a_refusal_quotes_the_registrys_words_but_no_token(tmp_path):
    class Denying(Quiet):
        def do_GET(self):
            body = json.dumps({"errors": [{"code": "DENIED", "message": "requested access to the resource is denied",
                                           "detail": {"access_token": SECRET, "Authorization": "Basic " + SECRET}}]})
            self.reply(403, ("\x1b[31m" + body).encode())

    address, server = serve(Denying)
    try:
        with pytest.raises(RegistryError) as caught:
            Registry(address, timeout=5).manifest("team/x", "latest")
        text = str(caught.value) + caught.value.fix
        assert "HTTP 403" in text and "DENIED" in text and "\x1b" not in text
        assert SECRET not in text and "c2VjcmV0" not in text and len(str(caught.value)) < 300
    finally:
        server.shutdown()


@pytest.mark.parametrize("realm, sent_login", [("http://auth.example.com/token", False),
                                                ("https://auth.example.com/token", True)])
def test_a_login_never_goes_to_a_plain_http_token_service_of_an_https_registry(monkeypatch, realm, sent_login):
    client = Registry("registry.example.com")
    monkeypatch.setattr(client, "_credentials", lambda: ("robot", "s3cret"))
    calls = []

    def answer(method, url, headers=None, auth=None, **kwargs):
        calls.append((url, auth))
        reply = requests.Response()
        reply.raw = io.BytesIO(b'{"token": "t0k"}' if url.startswith(realm) else b"")
        if url.startswith(realm):
            reply.status_code = 200
        elif headers.get("Authorization"):
            reply.status_code = 404
        else:
            reply.status_code = 401
            reply.headers["WWW-Authenticate"] = f'Bearer realm="{realm}",service="registry.example.com"'
        return reply

    monkeypatch.setattr(client.session, "request", answer)
    if sent_login:
        assert client.manifest("team/x", "latest") is None
        assert (realm, ("robot", "s3cret")) in [(url.split("?")[0], auth) for url, auth in calls]
    else:
        with pytest.raises(RegistryError, match="plain-HTTP token service") as refused:
            client.manifest("team/x", "latest")
        assert "s3cret" not in str(refused.value) and [url for url, _ in calls if "auth.example" in url] == []
