"""Signing and attesting pushed images, and `verify-image`, against a real OCI registry.

The formats are checked byte for byte and verified with `cryptography` directly (no cosign binary
here); then images are pushed to Debian's docker-registry through the registry API (no Docker
engine needed) and tampered with the ways an attacker would: a moved tag, a signature copied
from another image, another key, an edited attestation, a relabelled image.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from build import signing
from build.audit.image_signature import verify_image
from build.oci.image import canonical, sha256_digest
from build.publish import attest
from build.publish.registry import Registry
from tests.fixtures.keys import write_p256_pair, write_rsa_key

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "ab" * 32
PROVENANCE = attest.Provenance(image="smoke", plan_key="1" * 64, lock_sha256="2" * 64, source_date_epoch=1700000000,
                               commit="3" * 40, tool_version="0.1.0")


def _key(tmp_path, name="signer"):
    private, public = write_p256_pair(tmp_path, name)
    return private, public, signing.load_private_key(private), signing.load_public_key(public)


@pytest.mark.unit
def test_signature_payload_is_cosigns_simple_signing_json_byte_for_byte():
    payload = attest.simple_signing_payload("registry.example.com:5000/team/qwen27b", DIGEST)
    assert payload == (b'{"critical":{"identity":{"docker-reference":"registry.example.com:5000/team/qwen27b"},'
                       b'"image":{"docker-manifest-digest":"' + DIGEST.encode() + b'"},'
                       b'"type":"cosign container image signature"},"optional":null}')
    assert attest.artifact_tag(DIGEST, "sig") == "sha256-" + "ab" * 32 + ".sig"
    assert attest.SIMPLE_SIGNING == "application/vnd.dev.cosign.simplesigning.v1+json"
    assert attest.SIGNATURE_ANNOTATION == "dev.cosignproject.cosign/signature"


@pytest.mark.unit
def test_signature_and_envelope_verify_with_cryptography_alone(tmp_path):
    _, public_path, key, _ = _key(tmp_path)
    public = serialization.load_pem_public_key(public_path.read_bytes())
    payload = attest.simple_signing_payload("r.example/a", DIGEST)
    signature = base64.b64decode(signing.sign(payload, key))
    public.verify(signature, payload, ec.ECDSA(hashes.SHA256()))   # raises if wrong

    envelope = json.loads(attest.envelope(PROVENANCE.statement("r.example/a", DIGEST), key))
    statement = base64.b64decode(envelope["payload"])
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    # DSSE v1 pre-authentication encoding, written out by hand from the spec
    pae = b"DSSEv1 28 application/vnd.in-toto+json " + str(len(statement)).encode() + b" " + statement
    public.verify(base64.b64decode(envelope["signatures"][0]["sig"]), pae, ec.ECDSA(hashes.SHA256()))
    body = json.loads(statement)
    assert body["_type"] == "https://in-toto.io/Statement/v1"
    assert body["predicateType"] == "https://slsa.dev/provenance/v1"
    assert body["subject"] == [{"name": "r.example/a", "digest": {"sha256": "ab" * 32}}]
    definition = body["predicate"]["buildDefinition"]
    assert definition["internalParameters"] == {"SOURCE_DATE_EPOCH": 1700000000}
    assert {d["digest"]["sha256"] for d in definition["resolvedDependencies"]} == {"1" * 64, "2" * 64}


@pytest.mark.unit
def test_artifact_manifest_layout():
    layer = b'{"x":1}'
    manifest = json.loads(attest.artifact_manifest(layer, attest.DSSE, {"predicateType": attest.PREDICATE_TYPE},
                                                   b"{}"))
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert manifest["layers"] == [{"mediaType": "application/vnd.dsse.envelope.v1+json", "size": 7,
                                   "digest": sha256_digest(layer),
                                   "annotations": {"predicateType": "https://slsa.dev/provenance/v1"}}]


# ---- against a real registry ---------------------------------------------------------------

def push_fake_image(client: Registry, path: str, tag: str, *, lock: str = "2" * 64, plan: str = "1" * 64,
                    salt: str = "") -> str:
    """A small single-layer image with the labels a build sets; returns its manifest digest."""
    layer = f"layer {salt}".encode()
    config = canonical({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers",
                                                                           "diff_ids": [sha256_digest(layer)]},
                        "config": {"Labels": {"io.ftimage.lock.sha256": lock, "io.ftimage.plan-key": plan}}})
    client.put_blob(path, layer)
    client.put_blob(path, config)
    manifest = canonical({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": len(config),
                                     "digest": sha256_digest(config)},
                          "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "size": len(layer),
                                      "digest": sha256_digest(layer)}]})
    return client.put_manifest(path, tag, manifest)


def statuses(rows) -> dict[str, str]:
    return {r.check: ("PASS" if r.passed else "FAIL") for r in rows}


def details(rows) -> dict[str, str]:
    return {r.check: r.detail for r in rows}


@pytest.mark.engine
def test_signed_image_verifies_by_digest_and_by_tag(registry, tmp_path):
    _, _, key, public = _key(tmp_path)
    client = Registry(registry.address)
    repository = f"{registry.address}/team/signed"
    digest = push_fake_image(client, "team/signed", "v1")
    made = attest.sign_and_attest(client, "team/signed", repository, digest, key, PROVENANCE)
    assert made["signature"] == f"{repository}:sha256-{digest[7:]}.sig"
    for reference in (f"{repository}@{digest}", f"{repository}:v1"):
        rows = verify_image(reference, public)
        assert statuses(rows) == {"manifest": "PASS", "signature": "PASS", "attestation": "PASS", "lock": "PASS"}, \
            details(rows)
    # the stored signature layer is exactly cosign's
    sig = json.loads(client.manifest("team/signed", f"sha256-{digest[7:]}.sig")[0].data)
    layer = sig["layers"][0]
    assert layer["mediaType"] == "application/vnd.dev.cosign.simplesigning.v1+json"
    assert client.blob("team/signed", layer["digest"]) == attest.simple_signing_payload(repository, digest)


@pytest.mark.engine
def test_a_moved_tag_a_copied_signature_and_another_key_are_refused(registry, tmp_path):
    _, _, key, public = _key(tmp_path)
    _, _, other_key, other_public = _key(tmp_path, "other")
    client = Registry(registry.address)
    repository = f"{registry.address}/team/moved"
    signed = push_fake_image(client, "team/moved", "v1", salt="signed")
    attest.sign_and_attest(client, "team/moved", repository, signed, key, PROVENANCE)

    # someone pushes another image under the signed tag
    swapped = push_fake_image(client, "team/moved", "v1", salt="swapped")
    rows = verify_image(f"{repository}:v1", public)
    assert statuses(rows) == {"manifest": "PASS", "signature": "FAIL", "attestation": "FAIL", "lock": "FAIL"}
    assert "no signature at sha256-" in details(rows)["signature"]

    # ... and copies the real signature and attestation beside it
    for suffix in ("sig", "att"):
        blob, media = client.manifest("team/moved", attest.artifact_tag(signed, suffix))
        client.put_manifest("team/moved", attest.artifact_tag(swapped, suffix), blob.data, media)
    rows = verify_image(f"{repository}:v1", public)
    assert statuses(rows)["signature"] == "FAIL" and statuses(rows)["attestation"] == "FAIL"
    assert f"it signs {signed}, not this image ({swapped})" in details(rows)["signature"]
    assert "its subject is not this image" in details(rows)["attestation"]

    # the genuine digest still verifies, but not with another key
    assert all(r.passed for r in verify_image(f"{repository}@{signed}", public))
    rows = verify_image(f"{repository}@{signed}", other_public)
    assert statuses(rows) == {"manifest": "PASS", "signature": "FAIL", "attestation": "FAIL", "lock": "FAIL"}
    assert "made by another key" in details(rows)["signature"]
    # an image signed by another key does not verify with ours
    third = push_fake_image(client, "team/moved", "v3", salt="third")
    attest.sign_and_attest(client, "team/moved", repository, third, other_key, PROVENANCE)
    assert statuses(verify_image(f"{repository}:v3", public))["signature"] == "FAIL"


@pytest.mark.engine
def test_an_edited_attestation_or_a_relabelled_image_is_refused(registry, tmp_path):
    _, _, key, public = _key(tmp_path)
    client = Registry(registry.address)
    repository = f"{registry.address}/team/edited"
    digest = push_fake_image(client, "team/edited", "v1")
    attest.sign_and_attest(client, "team/edited", repository, digest, key, PROVENANCE)

    # edit the statement (another lock), keep the signature
    tag = attest.artifact_tag(digest, "att")
    manifest = json.loads(client.manifest("team/edited", tag)[0].data)
    envelope = json.loads(client.blob("team/edited", manifest["layers"][0]["digest"]))
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["predicate"]["buildDefinition"]["resolvedDependencies"][1]["digest"]["sha256"] = "9" * 64
    envelope["payload"] = base64.b64encode(canonical(statement)).decode()
    forged = canonical(envelope)
    client.put_blob("team/edited", forged)
    manifest["layers"][0].update(digest=sha256_digest(forged), size=len(forged))
    client.put_manifest("team/edited", tag, canonical(manifest))
    rows = verify_image(f"{repository}@{digest}", public)
    assert statuses(rows) == {"manifest": "PASS", "signature": "PASS", "attestation": "FAIL", "lock": "FAIL"}
    assert "DSSE signature does not verify" in details(rows)["attestation"]

    # an image whose lock label differs from what its (genuine) attestation records
    relabelled = push_fake_image(client, "team/edited", "v2", lock="8" * 64, salt="relabelled")
    attest.sign_and_attest(client, "team/edited", repository, relabelled, key, PROVENANCE)
    rows = verify_image(f"{repository}:v2", public)
    assert statuses(rows) == {"manifest": "PASS", "signature": "PASS", "attestation": "PASS", "lock": "FAIL"}
    assert "io.ftimage.lock.sha256 is 8888" in details(rows)["lock"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "build", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.engine
def test_verify_image_cli_exit_codes(registry, tmp_path):
    private, public_path, key, _ = _key(tmp_path)
    _, other_public, _, _ = _key(tmp_path, "other")
    client = Registry(registry.address)
    repository = f"{registry.address}/team/cli"
    digest = push_fake_image(client, "team/cli", "v1")
    attest.sign_and_attest(client, "team/cli", repository, digest, key, PROVENANCE)
    ok = run_cli("verify-image", f"{repository}@{digest}", "--key", str(public_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "RESULT: VERIFIED" in ok.stdout
    refused = run_cli("verify-image", f"{repository}@{digest}", "--key", str(other_public), "--json")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    report = json.loads(refused.stdout)
    assert report["verified"] is False and [r["status"] for r in report["rows"]] == ["PASS", "FAIL", "FAIL", "FAIL"]
    missing = run_cli("verify-image", f"{repository}:nosuchtag", "--key", str(public_path))
    assert missing.returncode == 3 and "has no manifest nosuchtag" in missing.stdout


@pytest.mark.unit
@pytest.mark.parametrize("case", ["rsa", "not-a-key", "private-as-public"])
def test_bad_keys_are_exit_2_with_a_fix(tmp_path, case):
    private, public = write_p256_pair(tmp_path)
    if case == "rsa":
        argv = ["images/smoke", "--push", "127.0.0.1:5999/x/y", "--sign", str(write_rsa_key(tmp_path))]
        expected = "is not a P-256 (prime256v1) private key"
    elif case == "not-a-key":
        junk = tmp_path / "junk.pem"
        junk.write_text("hello\n")
        argv = ["verify-image", "127.0.0.1:5999/x/y:v1", "--key", str(junk)]
        expected = "is not a PEM public key"
    else:
        argv = ["verify-image", "127.0.0.1:5999/x/y:v1", "--key", str(private)]
        expected = "is not a PEM public key"
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr and "fix:" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.unit
def test_sign_without_push_and_bad_references_are_exit_2(tmp_path):
    private, public = write_p256_pair(tmp_path)
    proc = run_cli("images/smoke", "--sign", str(private), "--plan")
    assert proc.returncode == 2 and "there is no --push" in proc.stderr, proc.stderr
    for bad in ("docker.io/x@sha256:1234", "smoke:latest", "https://r.example/x:v1"):
        proc = run_cli("verify-image", bad, "--key", str(public))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (bad, proc.stderr)
