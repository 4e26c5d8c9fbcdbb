"""Sign and attest a pushed image, in the formats cosign reads, with no cosign binary.

Signature (what `cosign sign --key` writes, and `cosign verify --key` checks): the simple-signing
payload below, signed ECDSA P-256/SHA-256, stored as the single layer (media type
`application/vnd.dev.cosignproject.cosign...simplesigning.v1+json`) of an OCI manifest tagged
`sha256-<hex>.sig` in the image's repository; the base64 signature is that layer's annotation
`dev.cosignproject.cosign/signature`.

Attestation (what `cosign attest --key --type slsaprovenance1` writes): an in-toto statement
whose subject is the image's manifest digest, with a SLSA v1 provenance predicate recording what
built it (plan key, lock sha256, SOURCE_DATE_EPOCH, commit, tool version), wrapped in a DSSE
envelope signed with the same key, stored as the single layer of a manifest tagged
`sha256-<hex>.att`.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from build import signing
from build.oci.image import OCI_MANIFEST, canonical, sha256_digest
from build.publish.registry import Registry

SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
DSSE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO = "application/vnd.in-toto+json"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
BUILD_TYPE = "urn:ftimage:build:v1"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


def simple_signing_payload(repository: str, digest: str) -> bytes:
    """The exact bytes cosign signs: its own key order, no spaces."""
    return json.dumps({"critical": {"identity": {"docker-reference": repository},
                                    "image": {"docker-manifest-digest": digest},
                                    "type": "cosign container image signature"},
                       "optional": None}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Provenance:
    """What built an image; the attestation's predicate."""
    image: str
    plan_key: str
    lock_sha256: str
    source_date_epoch: int
    commit: str
    tool_version: str

    def statement(self, repository: str, digest: str) -> dict:
        return {"_type": STATEMENT_TYPE,
                "subject": [{"name": repository, "digest": {"sha256": digest.removeprefix("sha256:")}}],
                "predicateType": PREDICATE_TYPE,
                "predicate": {
                    "buildDefinition": {
                        "buildType": BUILD_TYPE,
                        "externalParameters": {"image": self.image, "source": {"commit": self.commit}},
                        "internalParameters": {"SOURCE_DATE_EPOCH": self.source_date_epoch},
                        "resolvedDependencies": [
                            {"uri": f"ftimage:build-plan/{self.image}", "digest": {"sha256": self.plan_key}},
                            {"uri": "ftimage:/etc/ftimage/build.lock.json", "digest": {"sha256": self.lock_sha256}},
                        ]},
                    "runDetails": {"builder": {"id": f"urn:ftimage:builder:{self.tool_version}"}}}}


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the envelope's signature covers."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def envelope(statement: dict, key) -> bytes:
    payload = canonical(statement)
    return canonical({"payloadType": IN_TOTO, "payload": base64.b64encode(payload).decode(),
                      "signatures": [{"keyid": "", "sig": signing.sign(pae(IN_TOTO, payload), key)}]})


def artifact_manifest(layer: bytes, layer_type: str, annotations: dict[str, str], config: bytes) -> bytes:
    return canonical({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                      "config": {"mediaType": OCI_CONFIG, "size": len(config), "digest": sha256_digest(config)},
                      "layers": [{"mediaType": layer_type, "size": len(layer), "digest": sha256_digest(layer),
                                  "annotations": annotations}]})


def artifact_tag(digest: str, suffix: str) -> str:
    return f"{digest.replace(':', '-')}.{suffix}"


def _config_for(layer: bytes) -> bytes:
    # cosign's artifacts carry a minimal image config naming their one layer
    return canonical({"architecture": "", "os": "", "config": {},
                      "rootfs": {"type": "layers", "diff_ids": [sha256_digest(layer)]}})


def push_artifact(registry: Registry, path: str, digest: str, suffix: str, layer: bytes, layer_type: str,
                  annotations: dict[str, str]) -> str:
    """Store one signature/attestation manifest beside the image; returns its tag."""
    config = _config_for(layer)
    registry.put_blob(path, config)
    registry.put_blob(path, layer)
    tag = artifact_tag(digest, suffix)
    registry.put_manifest(path, tag, artifact_manifest(layer, layer_type, annotations, config))
    return tag


def sign_and_attest(registry: Registry, path: str, repository: str, digest: str, key,
                    provenance: Provenance) -> dict[str, str]:
    """Push the image's signature and provenance attestation; returns what build-report records."""
    payload = simple_signing_payload(repository, digest)
    sig_tag = push_artifact(registry, path, digest, "sig", payload, SIMPLE_SIGNING,
                            {SIGNATURE_ANNOTATION: signing.sign(payload, key)})
    att_tag = push_artifact(registry, path, digest, "att", envelope(provenance.statement(repository, digest), key),
                            DSSE, {"predicateType": PREDICATE_TYPE})
    return {"signature": f"{repository}:{sig_tag}", "attestation": f"{repository}:{att_tag}",
            "key": signing.key_id(key)}
