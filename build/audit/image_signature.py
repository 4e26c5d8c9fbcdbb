"""`python -m build verify-image REF --key PUB`: before a cluster deploys an image, prove that the
registry serves what this project built and signed.

Rows, each PASS or FAIL (any FAIL is exit 3):
  manifest     REF resolves to one image manifest (a tag is resolved to the digest it names now)
  signature    a cosign signature stored beside that digest verifies with PUB, and its payload
               names exactly this digest and this repository (a signature copied from another
               image, or made by another key, fails)
  attestation  the provenance attestation's DSSE signature verifies with PUB, and its subject is
               this digest
  lock         the image's `io.ftimage.lock.sha256` label equals the lock the attestation records,
               and the plan key label equals the attested plan key
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

from build import signing
from build.publish.attest import DSSE, IN_TOTO, PREDICATE_TYPE, SIGNATURE_ANNOTATION, SIMPLE_SIGNING, artifact_tag, pae
from build.publish.reference import DIGEST, PushReferenceErrors, parse_push_target
from build.publish.registry import Registry, RegistryError
from contracts.schema import Problem
from contracts.table import render_table

LOCK_LABEL = "io.ftimage.lock.sha256"
PLAN_LABEL = "io.ftimage.plan-key"


@dataclass
class Row:
    check: str
    passed: bool
    detail: str


class Refused(Exception):
    """One check failed; the message says why."""


def split_reference(value: str) -> tuple[str, str]:
    """(REGISTRY/REPO, tag or digest); the name is checked with --push's grammar (exit 2 if bad)."""
    name, at, digest = value.partition("@")
    if at:
        if not re.fullmatch(DIGEST, digest):
            raise PushReferenceErrors([Problem("verify-image", "digest", f"{digest[:80]!r} is not a sha256 digest",
                                               "write REGISTRY/REPO@sha256:<64 hex>, as build-report.json records")])
        reference = digest
    else:
        last = name.rpartition("/")[2]
        name, reference = (name.rpartition(":")[0], last.rpartition(":")[2]) if ":" in last else (name, "latest")
    target = parse_push_target(name, file="verify-image")
    return target.repository, reference


def _json(data: bytes, what: str) -> dict:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise Refused(f"the {what} is not JSON") from None
    if not isinstance(value, dict):
        raise Refused(f"the {what} is not a JSON object")
    return value


def _layers(registry: Registry, path: str, tag: str, media_type: str, what: str) -> list[tuple[dict, bytes]]:
    found = registry.manifest(path, tag)
    if found is None:
        raise Refused(f"no {what} at {tag} (the image was not signed with --sign, or this digest is not "
                      "the one that was signed)")
    manifest = _json(found[0].data, f"{what} manifest")
    layers = [layer for layer in manifest.get("layers") or [] if isinstance(layer, dict)
              and layer.get("mediaType") == media_type and isinstance(layer.get("digest"), str)]
    if not layers:
        raise Refused(f"the {what} manifest at {tag} holds no {media_type} layer")
    return [(layer, registry.blob(path, layer["digest"])) for layer in layers[:16]]


def check_signature(registry: Registry, path: str, repository: str, digest: str, key) -> str:
    reasons = []
    for layer, payload in _layers(registry, path, artifact_tag(digest, "sig"), SIMPLE_SIGNING, "signature"):
        signature = str((layer.get("annotations") or {}).get(SIGNATURE_ANNOTATION, ""))
        if not signing.verify(payload, signature, key):
            reasons.append(f"made by another key than {signing.key_id(key)[:23]}..., or altered")
            continue
        critical = _json(payload, "signature payload").get("critical") or {}
        signed = (critical.get("image") or {}).get("docker-manifest-digest")
        identity = (critical.get("identity") or {}).get("docker-reference")
        if signed != digest:
            reasons.append(f"it signs {str(signed)[:71]}, not this image ({digest})")
        elif identity != repository:
            reasons.append(f"it was made for {str(identity)[:200]}, not {repository}")
        else:
            return f"cosign signature by {signing.key_id(key)[:23]}... over {digest[:19]}... for {repository}"
    raise Refused("signature refused: " + "; ".join(reasons))


def check_attestation(registry: Registry, path: str, digest: str, key) -> dict:
    reasons = []
    for _layer, data in _layers(registry, path, artifact_tag(digest, "att"), DSSE, "attestation"):
        envelope = _json(data, "attestation envelope")
        try:
            payload = base64.b64decode(str(envelope.get("payload", "")), validate=True)
        except (binascii.Error, ValueError):
            reasons.append("its payload is not base64")
            continue
        kind = str(envelope.get("payloadType", ""))
        signatures = [s for s in envelope.get("signatures") or [] if isinstance(s, dict)]
        if kind != IN_TOTO or not any(signing.verify(pae(kind, payload), str(s.get("sig", "")), key)
                                      for s in signatures):
            reasons.append(f"its DSSE signature does not verify with {signing.key_id(key)[:23]}... (altered, or "
                           "another key)")
            continue
        statement = _json(payload, "attestation statement")
        subjects = [s.get("digest", {}).get("sha256") for s in statement.get("subject") or [] if isinstance(s, dict)]
        if digest.removeprefix("sha256:") not in subjects:
            reasons.append(f"its subject is not this image ({digest[:19]}...)")
        elif statement.get("predicateType") != PREDICATE_TYPE:
            reasons.append(f"its predicate is {str(statement.get('predicateType'))[:80]}, not SLSA provenance v1")
        else:
            return statement
    raise Refused("attestation refused: " + "; ".join(reasons))


def attested(statement: dict) -> dict[str, str]:
    definition = (statement.get("predicate") or {}).get("buildDefinition") or {}
    found = {}
    for dep in definition.get("resolvedDependencies") or []:
        uri, sha = str(dep.get("uri", "")), str((dep.get("digest") or {}).get("sha256", ""))
        if uri.startswith("ftimage:build-plan/"):
            found["plan_key"] = sha
        elif uri == "ftimage:/etc/ftimage/build.lock.json":
            found["lock_sha256"] = sha
    return found


def verify_image(reference: str, key, registry: Registry | None = None) -> list[Row]:
    repository, ref = split_reference(reference)
    registry_host, _, path = repository.partition("/")
    registry = registry or Registry(registry_host)
    rows: list[Row] = []

    def run(check: str, step) -> object:
        try:
            value, detail = step()
            rows.append(Row(check, True, detail))
            return value
        except (Refused, RegistryError) as exc:
            rows.append(Row(check, False, str(exc)))
            return None

    def resolve():
        found = registry.manifest(path, ref)
        if found is None:
            raise Refused(f"{repository} has no manifest {ref}")
        blob, media = found
        manifest = _json(blob.data, "image manifest")
        if "config" not in manifest or not isinstance(manifest["config"], dict):
            raise Refused(f"{reference} is not a single image manifest ({media or 'unknown type'})")
        return (blob.digest, manifest), f"{reference} is {repository}@{blob.digest}"

    resolved = run("manifest", resolve)
    if resolved is None:
        return rows
    digest, manifest = resolved
    run("signature", lambda: (None, check_signature(registry, path, repository, digest, key)))

    def attestation():
        statement = check_attestation(registry, path, digest, key)
        return statement, f"SLSA provenance v1 for {digest[:19]}..., signed by the same key"

    statement = run("attestation", attestation)

    def lock():
        if statement is None:
            raise Refused("no verified attestation to compare the image's lock with")
        config = _json(registry.blob(path, manifest["config"]["digest"]), "image config")
        labels = (config.get("config") or {}).get("Labels") or {}
        claims = attested(statement)
        for label, name in ((LOCK_LABEL, "lock_sha256"), (PLAN_LABEL, "plan_key")):
            if labels.get(label) != claims.get(name) or not claims.get(name):
                raise Refused(f"the image's {label} is {str(labels.get(label))[:64]}, the attestation records "
                              f"{str(claims.get(name))[:64]}")
        return None, (f"lock sha256 {claims['lock_sha256'][:16]}... and plan key {claims['plan_key'][:16]}... "
                      "as attested")

    run("lock", lock)
    return rows


def render(rows: list[Row]) -> str:
    return render_table([[r.check, "PASS" if r.passed else "FAIL", r.detail] for r in rows],
                        ["CHECK", "STATUS", "DETAIL"])
