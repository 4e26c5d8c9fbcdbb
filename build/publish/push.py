"""`--push REGISTRY/REPO`: push the built image as `REGISTRY/REPO:<its tag>` and record the
registry's digest in build-report.json. An assembled image (the default builder) goes from its
OCI layout through the registry API, so the digest is the build's own; an image from the
classic builder goes through the engine (`docker push`). Either way deploy examples pin the
image by content (`REGISTRY/REPO@sha256:...`) instead of by a tag anyone can move.

The reference is checked before any build work (exit 2, reference.py). A failed push is exit 1,
with the registry's own words and what to do about them.
"""
from __future__ import annotations

import re
import subprocess
import tomllib
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from build import signing
from build.build_report import REPORT_NAME, BuildReport, PushRecord
from build.errors import BuildFailure
from build.publish.attest import Provenance, sign_and_attest
from build.publish.pull_check import check_pull
from build.publish.reference import DIGEST, PushTarget
from build.publish.registry import EnginePushClient, LayoutPushClient, PushClient, Registry, engine_allows_plain_http
from build.source_date import source_date_epoch
from build.spec import REPO_ROOT
from contracts import atomic
from contracts.events import EventLog, Progress

LAYER_DONE = ("Pushed", "Layer already exists")


# ---- the push -----------------------------------------------------------------------------

def push_image(report: BuildReport, target: PushTarget, *, out_dir: Path | None, log: EventLog,
               client: PushClient | None = None, sign_key=None) -> PushRecord:
    """Push the image `report` describes to `target`, record the digest in `report.pushed` and, given
    `out_dir`, in its build report (written atomically); return the record. With `sign_key`, also push a
    cosign signature and a provenance attestation for that digest (attest.py). With `target.pull_check`,
    containerd pulls the pushed digest first, and a refusal fails the push (pull_check.py)."""
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
    if target.pull_check is not None:   # before the record and the signature: a refused image gets neither
        check_pull(target.pull_check, target.registry, record.reference, log=log)
    if sign_key is not None:
        record = _sign(record, report, target, sign_key, log)
    report.pushed = record.to_dict()
    if out_dir is not None:   # build_and_publish writes the report itself, once, after the remote cache's flush
        atomic.write_text(Path(out_dir) / REPORT_NAME, report.to_json())
    log.emit("push", f"pushed {record.reference}")
    return record


def _sign(record: PushRecord, report: BuildReport, target: PushTarget, key, log: EventLog) -> PushRecord:
    provenance = Provenance(image=report.image, plan_key=report.plan_key, lock_sha256=report.lock_sha256,
                            source_date_epoch=source_date_epoch(), commit=_commit(), tool_version=_tool_version())
    log.emit("push", f"signing {record.reference} with key {signing.key_id(key)[:23]}...")
    made = sign_and_attest(Registry(target.registry), target.path, target.repository, record.digest, key, provenance)
    log.emit("push", f"signature {made['signature']}, attestation {made['attestation']}")
    return replace(record, signature=made["signature"], attestation=made["attestation"], signed_by=made["key"])


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out.stdout.strip()) \
        else "unknown"


def _tool_version() -> str:
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
