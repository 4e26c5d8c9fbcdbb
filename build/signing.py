"""Key-based signatures in cosign's format, offline: ECDSA P-256 over SHA-256, DER-encoded and
base64'd, exactly what `cosign sign-blob --key` writes and `cosign verify-blob --key` checks.

One module signs everything the project hands to another machine: kernel exports (their
manifest) and, with the registry helpers, pushed images.
"""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from build.errors import SigningError

KEY_LIMIT = 64 * 1024


def _read(path: Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()[:KEY_LIMIT + 1]
    except OSError as exc:
        raise SigningError(f"cannot read the {what} {path}: {exc.strerror}", f"pass a readable {what} file") from None
    if len(data) > KEY_LIMIT:
        raise SigningError(f"{path} is not a {what} (over {KEY_LIMIT // 1024} KiB)", f"pass a PEM {what} file")
    return data


def load_private_key(path: Path, password: bytes | None = None) -> ec.EllipticCurvePrivateKey:
    data = _read(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=password)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path} is not a PEM private key ({str(exc).splitlines()[0][:120]})",
                           "generate one: openssl ecparam -name prime256v1 -genkey -noout -out key.pem "
                           "(or `cosign generate-key-pair`, unencrypted)") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise SigningError(f"{path} is not a P-256 (prime256v1) private key", "sign with an ECDSA P-256 key, as cosign "
                           "uses: openssl ecparam -name prime256v1 -genkey -noout -out key.pem")
    return key


def load_public_key(path: Path) -> ec.EllipticCurvePublicKey:
    data = _read(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path} is not a PEM public key ({str(exc).splitlines()[0][:120]})",
                           "pass the public half of the signing key (openssl ec -in key.pem -pubout)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise SigningError(f"{path} is not a P-256 public key", "pass the public half of the P-256 signing key")
    return key


def public_pem(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> bytes:
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> str:
    """sha256 of the public key's DER: names a key in logs and reports without showing it."""
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def sign(payload: bytes, key: ec.EllipticCurvePrivateKey) -> str:
    """base64 of the DER ECDSA-SHA256 signature (cosign's `.sig` / annotation value)."""
    return base64.b64encode(key.sign(payload, ec.ECDSA(hashes.SHA256()))).decode()


def verify(payload: bytes, signature_b64: str, key: ec.EllipticCurvePublicKey) -> bool:
    try:
        signature = base64.b64decode(signature_b64.strip().encode(), validate=True)
        key.verify(signature, payload, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True
