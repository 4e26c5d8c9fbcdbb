"""Signatures of remote cache entries, in the format this project signs images with: a cosign
simple-signing payload naming the cache repository and the entry manifest's digest, stored as
the manifest tagged `sha256-<hex>.sig` beside it (build/publish/attest.py writes it, the checks
of `verify-image`, build/audit/image_signature.py, read it).

The signature is pushed BEFORE the entry's tag (its tag is named by the manifest's digest,
known before the manifest is stored), so a tag never points at an entry whose signature is
still on its way: a runner reading during another's push sees the old entry or a signed one.
"""
from __future__ import annotations

from build import signing
from build.audit.image_signature import Refused, check_signature
from build.publish.attest import (
    SIGNATURE_ANNOTATION,
    SIMPLE_SIGNING,
    artifact_tag,
    push_artifact,
    simple_signing_payload,
)
from build.publish.registry import ContentError, Registry
from build.remote_cache.wire import Untrusted

__all__ = ["Untrusted", "sign_entry", "signature_tag", "verify_entry"]


def signature_tag(digest: str) -> str:
    return artifact_tag(digest, "sig")


def sign_entry(registry: Registry, path: str, repository: str, digest: str, key) -> str:
    """Store the signature of the entry manifest `digest`; returns its tag."""
    payload = simple_signing_payload(repository, digest)
    return push_artifact(registry, path, digest, "sig", payload, SIMPLE_SIGNING,
                         {SIGNATURE_ANNOTATION: signing.sign(payload, key)})


def verify_entry(registry: Registry, path: str, repository: str, digest: str, key) -> str:
    """What verified (for the log); Untrusted says why not (a signature that is missing, or
    whose blob is missing or not its digest's, refuses this entry only). RegistryError when the
    registry cannot be asked."""
    try:
        if registry.manifest(path, signature_tag(digest)) is None:
            raise Untrusted(f"it is unsigned (no {signature_tag(digest)} beside it)")
        return check_signature(registry, path, repository, digest, key)
    except Refused as exc:
        raise Untrusted(str(exc)) from None
    except ContentError as exc:
        raise Untrusted(f"its signature cannot be read: {exc}") from None
