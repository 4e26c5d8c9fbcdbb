"""The one registry client: everything this tool says to a registry, whichever way it goes.

  * `Registry`: the OCI distribution API over HTTP(S). It reads manifests and blobs (verify-image,
    build/audit/image_signature.py), writes the small JSON documents a signed push adds beside an
    image (build/publish/attest.py), and uploads an assembled image's blobs, streamed, and its
    manifest. It speaks what dockerd speaks: HTTPS, except plain HTTP for 127.0.0.0/8 and
    localhost (and, for a push, any registry the engine lists in `insecure-registries`:
    `engine_allows_plain_http`); anonymous, Basic, or Bearer-token auth with the credentials
    `docker login` stored, read through the docker SDK's own config loader and never printed.
    A stored manifest's Docker-Content-Digest must be the sha256 of the bytes sent.
  * `PushClient`: what build/publish/push.py needs to push an image, with two implementations.
    `LayoutPushClient` pushes an assembled image from its OCI layout, blob by blob through
    `Registry`: `docker push` would recompress the layers, so the pushed digest would be the
    engine's, not the build's; here the registry receives the exact blobs and manifest the build
    wrote, so the digest in build-report.json is the one a deployment pins, from any machine that
    builds the same inputs. `EnginePushClient` is `docker push` through the engine, for an image
    from the classic builder (`--builder dockerfile`). Both report as dockerd does: a stream of
    per-layer status items, the digest in an `aux` item, errors as `error` items.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from build.errors import BuildFailure
from build.oci.image import OCI_MANIFEST, read_layout, sha256_digest
from build.publish.deadline import Deadline, deadline, network_errors, watch_session
from contracts.redact import quote

MANIFEST_TYPES = (OCI_MANIFEST, "application/vnd.docker.distribution.manifest.v2+json")
MAX_DOCUMENT = 4 << 20      # manifests, configs, signatures and attestations are small; refuse a flood
TIMEOUT = 60                # seconds an operation may take in all (an upload: plus its size at PUSH_RATE)
PUSH_RATE = 256 << 10       # bytes per second an image blob upload may not fall below, on average


class RegistryError(BuildFailure):
    """The registry refused or could not be reached (exit 1 in `--push`, 3 in verify-image)."""


class ContentError(RegistryError):
    """The registry answered, and what it serves is missing or is not what it is named by (a
    blob that is not there, or whose bytes have another digest): the fault of the document that
    points at it, not of the registry's reachability."""


@dataclass(frozen=True)
class Blob:
    digest: str
    data: bytes


def _plain_http(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
    return host in ("localhost", "[::1]") or re.fullmatch(r"127(?:\.\d{1,3}){3}", host) is not None


class Registry:
    def __init__(self, registry: str, session=None, *, plain_http: bool = False, timeout: float = TIMEOUT):
        """`plain_http`: also speak HTTP off loopback (a registry the engine lists as insecure).
        `timeout`: seconds each operation may take, wall clock, from connecting to the last byte."""
        # requests and the docker SDK load on use: `--plan` and `kernels build-here` run without them
        import requests

        self.registry = registry
        self.base = f"{'http' if plain_http or _plain_http(registry) else 'https'}://{registry}/v2"
        self.session = session or requests.Session()
        watch_session(self.session)
        self.timeout = timeout
        self._token: str | None = None

    @contextmanager
    def _operation(self, what: str, seconds: float | None = None) -> Iterator[Deadline]:
        """One operation ("serve the manifest ...") under a wall-clock deadline of `seconds`
        (default: `timeout`): past it the connection is cut and RegistryError says so; any
        network failure inside becomes a RegistryError that names it."""
        with deadline(self.timeout if seconds is None else seconds) as bound:
            try:
                yield bound
            except Exception as exc:
                if bound.expired:      # whatever a cut connection made the reader say
                    raise self._late(what, bound.seconds) from None
                if isinstance(exc, network_errors()) and not isinstance(exc, RegistryError):
                    raise RegistryError(f"lost {self.registry} while trying to {what}: {_cause(exc)}",
                                        "check the network to the registry") from None
                raise
            if bound.expired:          # a body cut short without an error: never used
                raise self._late(what, bound.seconds)

    late_fix = "check the network to the registry, and that the registry is not overloaded"

    def _late(self, what: str, seconds: float) -> RegistryError:
        return RegistryError(f"{self.registry} timed out: it did not {what} within {seconds:g}s", self.late_fix)

    # ---- auth ---------------------------------------------------------------------------------

    def _credentials(self) -> tuple[str, str] | None:
        from docker import auth  # the docker SDK only for a login (see __init__)
        from docker.errors import DockerException

        try:
            config = auth.load_config()
            entry = auth.resolve_authconfig(config, self.registry) or {}
        except (OSError, ValueError, DockerException):   # an unreadable docker config: anonymous, as the CLI
            return None
        if entry.get("username") and entry.get("password"):
            return entry["username"], entry["password"]
        return None

    def _authorize(self, challenge: str) -> None:
        scheme, _, params = challenge.partition(" ")
        creds = self._credentials()
        if scheme.lower() == "basic":
            if creds is None:
                raise RegistryError(f"{self.registry} needs a login", f"`docker login {self.registry}` first")
            self._token = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            return
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        if scheme.lower() != "bearer" or not fields.get("realm", "").startswith(("https://", "http://")):
            raise RegistryError(f"{self.registry} asked for an unsupported authentication ({scheme[:40]})",
                                "use a registry that accepts Basic or Bearer-token auth")
        if creds and fields["realm"].startswith("http://") and self.base.startswith("https://"):
            raise RegistryError(f"{self.registry} (HTTPS) sent its login to a plain-HTTP token service; "
                                "the login was not sent", "give the registry's token service an https:// realm")
        query = {k: v for k, v in fields.items() if k in ("service", "scope")}
        answer = self._send("GET", fields["realm"], params=query, auth=creds, authorize=False)
        if answer.status_code != 200:
            raise RegistryError(f"{self.registry}'s token service refused: HTTP {answer.status_code}",
                                f"`docker login {self.registry}` as an account with access")
        try:
            body = answer.json()
        except ValueError:
            body = None
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not isinstance(token, str) or not re.fullmatch(r"[\x21-\x7e]{1,16384}", token):
            raise RegistryError(f"{self.registry}'s token service answered without a usable token "
                                "(not a JSON object holding one)", "check the registry's token service (its realm)")
        self._token = "Bearer " + token

    def _send(self, method: str, url: str, *, authorize: bool = True, **kw):
        import requests  # see __init__

        headers = dict(kw.pop("headers", {}))
        if authorize and self._token:
            headers["Authorization"] = self._token
        timeout = kw.pop("timeout", (self.timeout, self.timeout))
        try:
            answer = self.session.request(method, url, headers=headers, timeout=timeout, **kw)
        except requests.exceptions.RequestException as exc:
            raise RegistryError(f"cannot reach {self.registry}: {_cause(exc)}",
                                f"check that the registry at {self.registry} is up and reachable") from None
        if authorize and answer.status_code == 401 and "WWW-Authenticate" in answer.headers and \
                not headers.get("Authorization"):
            self._authorize(answer.headers["WWW-Authenticate"])
            return self._send(method, url, **kw, headers={k: v for k, v in headers.items()
                                                          if k != "Authorization"})
        return answer

    def _check(self, answer, what: str):
        """The answer, unless it is an error: then RegistryError, quoting a few words of its body
        (never a credential: contracts.redact.quote)."""
        if answer.status_code >= 400:
            try:
                head = next(answer.iter_content(512), b"")
            except Exception:  # noqa: BLE001 - a body that cannot be read is quoted as nothing
                head = b""
            raise RegistryError(f"{self.registry} refused to {what}: HTTP {answer.status_code} {quote(head)}".strip(),
                                "check the repository name and your access (`docker login`)")
        return answer

    # ---- reads --------------------------------------------------------------------------------

    def manifest(self, path: str, reference: str) -> tuple[Blob, str] | None:
        """(the manifest, its media type) by tag or digest; None when the registry has none."""
        what = f"serve the manifest {path}:{reference}"
        with self._operation(what):
            answer = self._send("GET", f"{self.base}/{path}/manifests/{reference}",
                                headers={"Accept": ", ".join(MANIFEST_TYPES)}, stream=True)
            if answer.status_code == 404:
                return None
            self._check(answer, what)
            data = _bounded(answer, "manifest")
            digest = sha256_digest(data)
            if reference.startswith("sha256:") and digest != reference:
                raise ContentError(f"{self.registry} served a manifest whose sha256 is {digest}, not {reference}",
                                   "the registry is corrupt or tampered with: do not deploy from it")
        media = answer.headers.get("Content-Type", "").split(";")[0]
        return Blob(digest, data), media

    def blob(self, path: str, digest: str) -> bytes:
        with self._operation(f"serve the blob {digest[:19]}"):
            answer = self._send("GET", f"{self.base}/{path}/blobs/{digest}", stream=True)
            if answer.status_code == 404:
                raise ContentError(f"{self.registry} has no blob {digest[:19]} in {path}",
                                   "the document that names it points at nothing: push it again")
            data = _bounded(self._check(answer, f"serve the blob {digest[:19]}"), "blob")
            if sha256_digest(data) != digest:
                raise ContentError(f"{self.registry} served blob {digest[:19]} with other content",
                                   "the registry is corrupt or tampered with: do not deploy from it")
        return data

    # ---- writes -------------------------------------------------------------------------------

    def put_blob(self, path: str, data: bytes) -> str:
        digest = sha256_digest(data)
        with self._operation("store a blob", self.timeout + len(data) / PUSH_RATE):
            if not self.has_blob(path, digest):
                self._check(self._send("PUT", self._start_upload(path), params={"digest": digest}, data=data,
                                       headers={"Content-Type": "application/octet-stream"}), "store a blob")
        return digest

    def _start_upload(self, path: str) -> str:
        """A new upload session's URL (the registry may answer with a path)."""
        with self._operation("start an upload"):
            start = self._check(self._send("POST", f"{self.base}/{path}/blobs/uploads/"), "start an upload")
        location = start.headers.get("Location", "")
        if not location:
            raise RegistryError(f"{self.registry} started an upload without a Location", "use an OCI registry")
        return self.base.rsplit("/v2", 1)[0] + location if location.startswith("/") else location

    def has_blob(self, path: str, digest: str) -> bool:
        with self._operation(f"say whether it has blob {digest[:19]}"):
            return self._send("HEAD", f"{self.base}/{path}/blobs/{digest}").status_code == 200

    def put_blob_file(self, path: str, file, digest: str, size: int) -> bool:
        """Upload a blob from a file, streamed (a venv layer is gigabytes); False when the registry
        had it already. The registry checks the digest against what it received."""
        with self._operation(f"store the blob {digest[:19]}", self.timeout + size / PUSH_RATE):
            if self.has_blob(path, digest):
                return False
            location = self._start_upload(path)
            with open(file, "rb") as fh:
                self._check(self._send("PUT", location, params={"digest": digest}, data=fh,
                                       timeout=(self.timeout, 3600), headers={
                                           "Content-Type": "application/octet-stream", "Content-Length": str(size)}),
                            f"store the blob {digest[:19]}")
        return True

    def put_manifest(self, path: str, tag: str, manifest: bytes, media_type: str = OCI_MANIFEST) -> str:
        with self._operation(f"store the manifest {tag}"):
            answer = self._check(self._send("PUT", f"{self.base}/{path}/manifests/{tag}", data=manifest,
                                            headers={"Content-Type": media_type}), f"store the manifest {tag}")
        stored = answer.headers.get("Docker-Content-Digest", "")
        if stored and stored != sha256_digest(manifest):
            raise RegistryError(f"{self.registry} stored the manifest as {stored}, not {sha256_digest(manifest)}",
                                "use a registry that keeps manifests byte for byte (OCI distribution)")
        return sha256_digest(manifest)


def _cause(exc: Exception) -> str:
    """The root of a requests error in a few words ("Connection refused", "[SSL: ...] wrong
    version number"), not urllib3's nested repr."""
    text = str(exc)
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text) or re.search(r"(\[SSL: [A-Z_]+\][^'\")\]]*)", text)
    return (found.group(1) if found else text.split("(Caused by")[0])[:200].strip()


def _bounded(answer, what: str) -> bytes:
    data = answer.raw.read(MAX_DOCUMENT + 1, decode_content=True)
    if len(data) > MAX_DOCUMENT:
        raise RegistryError(f"the registry sent a {what} over {MAX_DOCUMENT >> 20} MiB",
                            "this is not a signature, attestation or image manifest: check the reference")
    return data


def engine_allows_plain_http(registry: str) -> bool:
    """Whether the local engine is configured to reach `registry` over plain HTTP (dockerd's
    `insecure-registries`): a push from the layout follows the same setting `docker push` would."""
    try:
        from build.engine.docker_engine import DockerEngine  # the docker SDK (see Registry.__init__)

        config = DockerEngine.connect(timeout=10).client.info().get("RegistryConfig") or {}
    except (BuildFailure, OSError, ValueError):
        return False
    if (config.get("IndexConfigs") or {}).get(registry, {}).get("Secure") is False:
        return True
    host = registry.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    cidrs = config.get("InsecureRegistryCIDRs") or []
    return any(address in ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


# ---- pushing an image ---------------------------------------------------------------------

class PushClient(Protocol):
    """What a push needs: the engine's `docker push`, or the layout's through the registry API.
    Errors during the push arrive as `{"error": ...}` items in the stream (dockerd reports them
    there, not as HTTP status codes)."""

    def tag(self, image: str, repository: str, tag: str) -> None: ...

    def push(self, repository: str, tag: str) -> Iterable[dict[str, Any]]: ...

    def repo_digests(self, image: str) -> list[str]: ...

    def untag(self, reference: str) -> None: ...


class LayoutPushClient:
    """PushClient for an assembled image: its OCI layout, blob by blob through `Registry`."""

    def __init__(self, layout: Path, registry: Registry, path: str):
        self.layout, self.registry, self.path = Path(layout), registry, path

    def tag(self, image: str, repository: str, tag: str) -> None:
        """Nothing to tag: the layout is pushed, not an engine's image."""

    def untag(self, reference: str) -> None:
        """Nothing was tagged."""

    def repo_digests(self, image: str) -> list[str]:
        return []

    def push(self, repository: str, tag: str) -> Iterator[dict[str, Any]]:
        try:
            manifest, config, layers = read_layout(self.layout)
            described = json.loads(manifest)["layers"]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            yield {"error": f"the OCI layout {self.layout} is unreadable ({exc}): build again"}
            return
        try:
            for blob, entry in zip(layers, described, strict=True):
                short = entry["digest"][7:19]
                yield {"status": "Pushing", "id": short}
                sent = self.registry.put_blob_file(self.path, blob, entry["digest"], entry["size"])
                yield {"status": "Pushed" if sent else "Layer already exists", "id": short}
            config_digest = json.loads(manifest)["config"]["digest"]
            config_path = self.layout / "blobs" / "sha256" / config_digest.removeprefix("sha256:")
            self.registry.put_blob_file(self.path, config_path, config_digest, len(config))
            digest = self.registry.put_manifest(self.path, tag, manifest, OCI_MANIFEST)
        except RegistryError as exc:
            yield {"error": str(exc)}
            return
        yield {"aux": {"Tag": tag, "Digest": digest, "Size": len(manifest)}}


class EnginePushClient:
    """`docker push`: PushClient over the docker SDK's low-level API (the same engine the build used)."""

    def __init__(self, api):
        self.api = api

    @classmethod
    def connect(cls) -> EnginePushClient:
        from build.engine.docker_engine import DockerEngine  # the docker SDK (see Registry.__init__)

        return cls(DockerEngine.connect().client.api)

    def tag(self, image: str, repository: str, tag: str) -> None:
        with engine_errors("tag"):
            self.api.tag(image, repository, tag, force=True)

    def push(self, repository: str, tag: str) -> Iterator[dict[str, Any]]:
        import docker.errors  # the docker SDK (see Registry.__init__)

        with engine_errors("push"):
            try:
                yield from self.api.push(repository, tag=tag, stream=True, decode=True)
            except docker.errors.APIError as exc:   # refused before streaming (bad name, no such image)
                yield {"error": str(exc.explanation or exc)}

    def repo_digests(self, image: str) -> list[str]:
        with engine_errors("inspect"):
            return list(self.api.inspect_image(image).get("RepoDigests") or [])

    def untag(self, reference: str) -> None:
        import docker.errors  # the docker SDK (see Registry.__init__)

        try:
            self.api.remove_image(reference)
        except docker.errors.APIError:
            pass    # a tag we could not remove costs disk, not correctness


@contextmanager
def engine_errors(what: str) -> Iterator[None]:
    """dockerd refusing a call, or lost mid-push, is a failure with the engine's words (exit 1)."""
    import docker.errors  # the docker SDK and requests (see Registry.__init__)
    import requests.exceptions

    try:
        yield
    except docker.errors.APIError as exc:    # an HTTP error from dockerd itself, not from the registry
        raise BuildFailure(f"docker {what} failed: {exc.explanation or exc}",
                           "build the image again (something removed it?) and read the dockerd log") from None
    except requests.exceptions.RequestException as exc:
        from build.engine.docker_engine import ENGINE_FIX  # the docker SDK (see Registry.__init__)

        raise BuildFailure(f"lost the Docker engine during {what}: {str(exc).split('(Caused by')[0]}",
                           ENGINE_FIX) from None
