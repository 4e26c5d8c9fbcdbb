"""`--push REGISTRY/REPO`: push the built image as `REGISTRY/REPO:<its tag>` and record the
registry's digest in build-report.json. An assembled image (the default builder) goes from its
OCI layout through the registry API, so the digest is the build's own; an image from the
classic builder goes through the engine (`docker push`). Either way deploy examples pin the
image by content (`REGISTRY/REPO@sha256:...`) instead of by a tag anyone can move.

The reference is checked before any build work (exit 2). It names a registry and a repository
and nothing else: the tag is the image's own (`<name>:<plan key>` locally, so the pushed tag says
which plan built it), and a digest names content that exists already, which a push creates.
A failed push is exit 1, with the registry's own words and what to do about them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from build.errors import BuildFailure
from build.publish.registry import EnginePushClient, LayoutPushClient, PushClient, Registry, engine_allows_plain_http
from build.spec import REPO_ROOT
from build.spec.shapes import IMAGE_REF, SHA256
from contracts import atomic
from contracts.events import EventLog, Progress
from contracts.redact import mask_url
from contracts.schema import InvalidInput, Problem

if TYPE_CHECKING:   # the pipeline imports the whole build; a push only needs the report's fields
    from build.pipeline import BuildReport

# Docker's reference grammar (distribution/reference), split so each part can be named in an error.
PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
REGISTRY = rf"(?:{HOST_LABEL}(?:\.{HOST_LABEL})*|\[[0-9A-Fa-f:]+\])(?::(?P<port>[0-9]{{1,5}}))?"
DIGEST = rf"sha256:{SHA256}"
REFERENCE_CHARS = re.compile(r"[A-Za-z0-9._:/@\[\]-]")
MAX_NAME_LENGTH = 255            # distribution's limit on REGISTRY/PATH
REPORT_NAME = "build-report.json"
EXAMPLE = "registry.example.com:5000/team/qwen27b"
LAYER_DONE = ("Pushed", "Layer already exists")


class PushReferenceErrors(InvalidInput):
    """The --push value is not a registry repository we can push to (exit code 2)."""
    title = "the --push reference"


@dataclass(frozen=True)
class PushTarget:
    registry: str        # host[:port], as dockerd will dial it
    path: str            # the repository inside the registry, e.g. team/qwen27b

    @property
    def repository(self) -> str:
        return f"{self.registry}/{self.path}"


@dataclass(frozen=True)
class PushRecord:
    """What build-report.json keeps under `pushed` after a push."""
    repository: str      # REGISTRY/REPO
    tag: str             # REGISTRY/REPO:<image tag>, the name the image was pushed under
    digest: str          # sha256:<64 hex>, the manifest digest the registry stores
    reference: str       # REGISTRY/REPO@sha256:..., what a deployment pins
    signature: str = ""  # with --sign: REGISTRY/REPO:sha256-<hex>.sig (cosign's layout)
    attestation: str = ""  # with --sign: REGISTRY/REPO:sha256-<hex>.att (SLSA provenance, DSSE)
    signed_by: str = ""  # with --sign: sha256 of the signing key's public half

    def to_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v}   # an unsigned push records no signature fields


# ---- the reference ------------------------------------------------------------------------

def reference_problems(value: str, *, file: str = "--push", field: str = "") -> list[Problem]:
    """Every problem with `value` as a push target, each naming the part and its fix.
    `file` says where the value came from (the flag, or a report); `field`, if given, is the
    field every problem is filed under instead of the part of the reference."""
    problems: list[Problem] = []

    def add(part: str, problem: str, fix: str) -> None:
        problems.append(Problem(file, field or part, problem, fix))

    if not value.strip():
        add("reference", "is empty", f"name a registry and a repository, e.g. --push {EXAMPLE}")
        return problems
    if mask_url(value) != value:
        add("reference", f"{mask_url(value)[:120]!r} carries credentials or a token", "never put credentials in a "
            "reference: `docker login REGISTRY` (or the engine's credential helper) supplies them at push time")
        return problems
    bad = sorted({c for c in value if not REFERENCE_CHARS.fullmatch(c)})
    if bad:
        add("reference", f"{value[:120]!r} has characters no Docker reference holds: "
            f"{', '.join(repr(c) for c in bad)}", f"use only letters, digits and . _ - : / e.g. {EXAMPLE}")
        return problems
    rest = value
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", rest)
    if scheme:
        rest = rest[scheme.end():]
        add("registry", f"{value!r} starts with a URL scheme ({scheme.group(1)}://); a Docker reference has none",
            f"drop '{scheme.group(0)}': dockerd chooses HTTPS itself (a plain-HTTP registry other than "
            "127.0.0.1/localhost goes into dockerd's insecure-registries)")
    name, at, digest = rest.partition("@")
    tagged = "/" in name and ":" in name.rpartition("/")[2]   # before the first '/', a ':' is a port
    if at and tagged:
        add("reference", f"{value!r} has a tag AND a digest", "drop both: the build tags the image with its "
            "plan key and the registry returns the digest, which the build report records")
    elif at:
        add("digest", f"'@{digest}' is a digest: it names content already in a registry, and a push creates it",
            f"drop '@{digest[:20]}...': the digest is recorded in {REPORT_NAME} after the push")
    elif tagged:
        add("tag", f"{value!r} carries a tag ({name.rpartition(':')[2]!r}); the build chooses the tag "
            "(the image's plan key, so the tag says which plan built it)", f"drop it: --push {name.rpartition(':')[0]}")
    if tagged:
        name = name.rpartition(":")[0]
    parts = name.split("/")
    if any(not part for part in parts):
        add("repository", f"{name!r} has an empty part (a leading, trailing or doubled '/')",
            f"write REGISTRY/REPO with no empty parts, e.g. {EXAMPLE}")
        return problems
    registry = parts[0]
    looks_like_host = "." in registry or ":" in registry or registry == "localhost" or "[" in registry
    if len(parts) < 2 and looks_like_host:
        add("repository", f"{name!r} names a registry but no repository in it",
            f"add the repository path: --push {name}/team/{EXAMPLE.rpartition('/')[2]}")
        return problems
    if len(parts) < 2 or not looks_like_host:
        add("registry", f"{name!r} names no registry, so Docker would push it to Docker Hub",
            f"write REGISTRY/REPO, e.g. {EXAMPLE} (docker.io/team/qwen27b for Docker Hub, explicitly)")
        return problems
    host = re.fullmatch(REGISTRY, registry)
    if host is None:
        add("registry", f"{registry!r} is not a registry host[:port]", "write the host name or IP address, "
            "optionally with :PORT, e.g. registry.example.com:5000 or 127.0.0.1:5000")
    elif host.group("port") and not 0 < int(host.group("port")) < 65536:
        add("registry", f"port {host.group('port')} is out of range", "use a TCP port in 1..65535")
    path = "/".join(parts[1:])
    if path != path.lower():
        add("repository", f"{path!r} has uppercase letters; Docker repository paths are lowercase",
            f"write --push {registry}/{path.lower()}")
    else:
        for component in parts[1:]:
            if not re.fullmatch(PATH_COMPONENT, component):
                add("repository", f"{component!r} is not a Docker repository path component",
                    "use lowercase letters and digits, separated by '.', '_', '__' or '-' (not at either end)")
    if len(name) > MAX_NAME_LENGTH:
        add("repository", f"the name is {len(name)} characters long", f"keep REGISTRY/REPO within "
            f"{MAX_NAME_LENGTH} characters")
    if not problems and not re.fullmatch(IMAGE_REF, name):  # the spec's own grammar agrees (belt and braces)
        add("reference", f"{name!r} is not a Docker reference", f"write REGISTRY/REPO, e.g. {EXAMPLE}")
    return problems


def parse_push_target(value: str, *, file: str = "--push", field: str = "") -> PushTarget:
    problems = reference_problems(value, file=file, field=field)
    if problems:
        raise PushReferenceErrors(problems)
    registry, _, path = value.partition("/")
    return PushTarget(registry=registry, path=path)


def push_target_from_args(value: str | None, modes: dict[str, bool]) -> PushTarget | None:
    """The CLI's --push, checked before any build work. `modes` are the other flags that stop
    before an image exists (a push needs one) or read an earlier push instead of making one."""
    if value is None:
        return None
    clashing = [flag for flag, given in modes.items() if given]
    if clashing:
        raise PushReferenceErrors([Problem("--push", "reference", f"--push needs a built image, and {clashing[0]} "
                                           "builds none", f"leave out {clashing[0]}: python -m build IMAGE_DIR "
                                           "--push REGISTRY/REPO builds, then pushes")])
    return parse_push_target(value)


# ---- the push -----------------------------------------------------------------------------

def push_image(report: BuildReport, target: PushTarget, *, out_dir: Path, log: EventLog,
               client: PushClient | None = None, sign_key=None) -> PushRecord:
    """Push the image `report` describes to `target`, record the digest in out_dir's build report
    (written atomically) and in `report.pushed`; return the record. With `sign_key`, also push a
    cosign signature and a provenance attestation for that digest (attest.py)."""
    if client is None and report.layout:
        client = LayoutPushClient(Path(report.layout), Registry(
            target.registry, plain_http=engine_allows_plain_http(target.registry)), target.path)
    client = client or EnginePushClient.connect()
    tag = report.tag.rpartition(":")[2]
    remote = f"{target.repository}:{tag}"
    client.tag(report.image_id or report.tag, target.repository, tag)
    log.emit("push", f"pushing {report.tag} as {remote}")
    digest, error = follow_push(client.push(target.repository, tag), log, remote)
    if error:
        reason, fix = explain_push_error(error, target)
        client.untag(remote)
        raise BuildFailure(f"push to {target.registry} failed: {reason}", fix)
    prefix = f"{target.repository}@"
    digest = digest or next((d[len(prefix):] for d in client.repo_digests(remote) if d.startswith(prefix)), "")
    # The local REGISTRY/REPO tag goes once the digest is known: the build prunes superseded
    # images by their <name>:<key> tag, and a second tag would keep each one on disk.
    client.untag(remote)
    if not re.fullmatch(DIGEST, digest):
        raise BuildFailure(f"push to {target.registry} finished but returned no sha256 digest ({digest[:80]!r})",
                           f"check the registry's log, then push again: --push {target.repository}")
    record = PushRecord(repository=target.repository, tag=remote, digest=digest,
                        reference=f"{target.repository}@{digest}")
    if sign_key is not None:
        record = _sign(record, report, target, sign_key, log)
    report.pushed = record.to_dict()
    atomic.write_text(Path(out_dir) / REPORT_NAME, report.to_json())
    log.emit("push", f"pushed {record.reference}")
    return record


def _sign(record: PushRecord, report: BuildReport, target: PushTarget, key, log: EventLog) -> PushRecord:
    from dataclasses import replace

    from build import signing
    from build.publish.attest import Provenance, sign_and_attest
    from build.source_date import source_date_epoch

    provenance = Provenance(image=report.image, plan_key=report.plan_key, lock_sha256=report.lock_sha256,
                            source_date_epoch=source_date_epoch(), commit=_commit(), tool_version=_tool_version())
    log.emit("push", f"signing {record.reference} with key {signing.key_id(key)[:23]}...")
    made = sign_and_attest(Registry(target.registry), target.path, target.repository, record.digest, key, provenance)
    log.emit("push", f"signature {made['signature']}, attestation {made['attestation']}")
    return replace(record, signature=made["signature"], attestation=made["attestation"], signed_by=made["key"])


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out.stdout.strip()) \
        else "unknown"


def _tool_version() -> str:
    import tomllib

    try:
        pyproject = REPO_ROOT / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except (OSError, KeyError, ValueError):
        return "unknown"


def follow_push(stream: Iterable[dict[str, Any]], log: EventLog, remote: str) -> tuple[str, str]:
    """Read dockerd's push stream: per-layer progress as events; returns (digest, error), where
    the digest comes from the final `aux` item and the error from an `error` item."""
    progress = Progress(log, "push", remote, min_interval=2.0)
    layers: dict[str, str] = {}
    digest = error = ""
    for item in stream:
        if "error" in item:
            error = str((item.get("errorDetail") or {}).get("message") or item["error"]).strip()
            continue
        aux = item.get("aux") or {}
        if aux.get("Digest"):
            digest = str(aux["Digest"])
        status, layer = str(item.get("status") or ""), item.get("id")
        if layer and status:
            layers[layer] = status
            done = sum(1 for s in layers.values() if s in LAYER_DONE or s.startswith("Mounted from"))
            finished = status in LAYER_DONE or status.startswith("Mounted from")
            detail = item.get("progressDetail") or {}
            moved = (f" {detail['current'] / 2**20:.0f}/{detail['total'] / 2**20:.0f} MiB"
                     if status == "Pushing" and detail.get("total") else "")
            progress.update(done, f"{layer} {status}{moved}", total=len(layers), force=finished)
        elif status:
            log.emit("push", status)
    return digest, error


# The registry's message, matched to what the user can do about it (dockerd words them so).
_FIXES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("server gave http response to https client", "wrong version number"),
     "{registry} speaks plain HTTP, and dockerd uses HTTPS for every registry outside 127.0.0.0/8 "
     "(127.0.0.1, localhost): serve it over TLS, or add \"{registry}\" to \"insecure-registries\" in "
     "/etc/docker/daemon.json and restart dockerd"),
    (("connection refused", "no route to host", "i/o timeout", "connection reset", "network is unreachable"),
     "nothing answers at {registry}: start the registry there, or correct the host and port in --push"),
    (("no such host", "server misbehaving", "temporary failure in name resolution"),
     "the host name in {registry} does not resolve: correct it in --push"),
    (("x509", "certificate"),
     "dockerd does not trust {registry}'s TLS certificate: put its CA at /etc/docker/certs.d/{registry}/ca.crt"),
    (("unauthorized", "authentication required", "no basic auth credentials", "denied", "forbidden"),
     "`docker login {registry}` as an account that may push to {path} (the push reads ~/.docker/config.json)"),
    (("not found", "name unknown"),
     "the registry has no repository {path} and does not create one on push: create it there (a project "
     "or namespace first, on Harbor, GitLab or ECR), or correct the path in --push"),
)


def explain_push_error(message: str, target: PushTarget) -> tuple[str, str]:
    """(reason, fix) for a push error: the registry's message on one line, and what to do."""
    reason = " ".join(message.split())[:400] or "no reason given"
    lowered = reason.lower()
    for needles, fix in _FIXES:
        if any(needle in lowered for needle in needles):
            return reason, fix.format(registry=target.registry, path=target.path)
    return reason, f"read the registry's message; `docker push {target.repository}:TAG` shows the same"
