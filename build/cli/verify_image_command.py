"""`python -m build verify-image REF --key PUB [--json]`: check a pushed image's signature,
provenance attestation and lock label against a public key (build/audit/image_signature.py).
Exit 0 verified, 3 refused."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from build import signing
from build.audit.image_signature import render, verify_image
from build.cli.common import EXIT_OK, EXIT_REFUSED


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m build verify-image",
                                description="Check a pushed image's signature, provenance attestation and lock "
                                            "label against a public key. Exit 0 verified, 3 refused.")
    p.add_argument("reference", metavar="REF", help="REGISTRY/REPO@sha256:... (or REGISTRY/REPO:TAG, resolved now)")
    p.add_argument("--key", type=Path, required=True, help="the signer's P-256 public key (PEM)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    rows = verify_image(args.reference, signing.load_public_key(args.key))
    ok = all(r.passed for r in rows) and len(rows) == 4
    if args.json:
        print(json.dumps({"reference": args.reference, "verified": ok,
                          "rows": [{"check": r.check, "status": "PASS" if r.passed else "FAIL", "detail": r.detail}
                                   for r in rows]}, indent=2))
    else:
        print(render(rows))
        print(f"RESULT: {'VERIFIED' if ok else 'REFUSED'}")
    return EXIT_OK if ok else EXIT_REFUSED
