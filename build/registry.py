"""A small client for the OCI distribution API: read manifests and blobs, write the artifacts a
signed push adds (a signature and a provenance attestation) beside an image.

It pushes assembled images blob by blob from their OCI layout, so the registry stores the
manifest this tool wrote and the pushed digest is the build's own (build/oci/registry_push.py),
and it moves the small JSON documents a signed push adds. It speaks what dockerd speaks: HTTPS, except
plain HTTP for 127.0.0.0/8 and localhost; anonymous, Basic, or Bearer-token auth with the
credentials `docker login` stored (read through the docker SDK's own config loader).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass

from build.errors import BuildFailure

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
OCI_MANIFEST = MANIFEST_TYPES[0]
MAX_DOCUMENT = 4 << 20      # manifests, configs, signatures and attestations are small; refuse a flood
TIMEOUT = 60


class RegistryError(BuildFailure):
    """The registry refused or could not be reached (exit 1 in `--push`, 3 in verify-image)."""


@dataclass(frozen=True)
class Blob:
    digest: str
    data: bytes


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _plain_http(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
    return host in ("localhost", "[::1]") or re.fullmatch(r"127(?:\.\d{1,3}){3}", host) is not None


class Registry:
    def __init__(self, registry: str, session=None, *, plain_http: bool = False):
        """`plain_http`: also speak HTTP off loopback (a registry the engine lists as insecure)."""
        import requests

        self.registry = registry
        self.base = f"{'http' if plain_http or _plain_http(registry) else 'https'}://{registry}/v2"
        self.session = session or requests.Session()
        self._token: str | None = None

    # ---- auth ---------------------------------------------------------------------------------

    def _credentials(self) -> tuple[str, str] | None:
        from docker import auth
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
        query = {k: v for k, v in fields.items() if k in ("service", "scope")}
        answer = self._send("GET", fields["realm"], params=query, auth=creds, authorize=False)
        if answer.status_code != 200:
            raise RegistryError(f"{self.registry}'s token service refused: HTTP {answer.status_code}",
                                f"`docker login {self.registry}` as an account with access")
        body = answer.json()
        self._token = "Bearer " + str(body.get("token") or body.get("access_token") or "")

    def _send(self, method: str, url: str, *, authorize: bool = True, **kw):
        import requests

        headers = dict(kw.pop("headers", {}))
        if authorize and self._token:
            headers["Authorization"] = self._token
        timeout = kw.pop("timeout", TIMEOUT)
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
        if answer.status_code >= 400:
            text = " ".join(answer.text.split())[:300]
            raise RegistryError(f"{self.registry} refused to {what}: HTTP {answer.status_code} {text}",
                                "check the repository name and your access (`docker login`)")
        return answer

    # ---- reads --------------------------------------------------------------------------------

    def manifest(self, path: str, reference: str) -> tuple[Blob, str] | None:
        """(the manifest, its media type) by tag or digest; None when the registry has none."""
        answer = self._send("GET", f"{self.base}/{path}/manifests/{reference}",
                            headers={"Accept": ", ".join(MANIFEST_TYPES)}, stream=True)
        if answer.status_code == 404:
            return None
        self._check(answer, f"serve the manifest {path}:{reference}")
        data = _bounded(answer, "manifest")
        digest = sha256_digest(data)
        if reference.startswith("sha256:") and digest != reference:
            raise RegistryError(f"{self.registry} served a manifest whose sha256 is {digest}, not {reference}",
                                "the registry is corrupt or tampered with: do not deploy from it")
        media = answer.headers.get("Content-Type", "").split(";")[0]
        return Blob(digest, data), media

    def blob(self, path: str, digest: str) -> bytes:
        answer = self._check(self._send("GET", f"{self.base}/{path}/blobs/{digest}", stream=True),
                             f"serve the blob {digest[:19]}")
        data = _bounded(answer, "blob")
        if sha256_digest(data) != digest:
            raise RegistryError(f"{self.registry} served blob {digest[:19]} with other content",
                                "the registry is corrupt or tampered with: do not deploy from it")
        return data

    # ---- writes -------------------------------------------------------------------------------

    def put_blob(self, path: str, data: bytes) -> str:
        digest = sha256_digest(data)
        if not self.has_blob(path, digest):
            self._check(self._send("PUT", self._start_upload(path), params={"digest": digest}, data=data,
                                   headers={"Content-Type": "application/octet-stream"}), "store a blob")
        return digest

    def _start_upload(self, path: str) -> str:
        """A new upload session's URL (the registry may answer with a path)."""
        start = self._check(self._send("POST", f"{self.base}/{path}/blobs/uploads/"), "start an upload")
        location = start.headers.get("Location", "")
        if not location:
            raise RegistryError(f"{self.registry} started an upload without a Location", "use an OCI registry")
        return self.base.rsplit("/v2", 1)[0] + location if location.startswith("/") else location

    def has_blob(self, path: str, digest: str) -> bool:
        return self._send("HEAD", f"{self.base}/{path}/blobs/{digest}").status_code == 200

    def put_blob_file(self, path: str, file, digest: str, size: int) -> bool:
        """Upload a blob from a file, streamed (a venv layer is gigabytes); False when the registry
        had it already. The registry checks the digest against what it received."""
        if self.has_blob(path, digest):
            return False
        location = self._start_upload(path)
        with open(file, "rb") as fh:
            self._check(self._send("PUT", location, params={"digest": digest}, data=fh, timeout=(TIMEOUT, 3600),
                                   headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}),
                        f"store the blob {digest[:19]}")
        return True

    def put_manifest(self, path: str, tag: str, manifest: bytes, media_type: str = OCI_MANIFEST) -> str:
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


def canonical(document) -> bytes:
    """The one JSON encoding of a document this tool writes (sorted keys, no spaces)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
