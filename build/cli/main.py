"""`python -m build`: a thin CLI over the build library. This module reads the command word and
maps failures to exit codes; each command lives in its own module (the list: EPILOG, common.py):

    IMAGE_DIR ...              build_command.py plan, render, build, push, sign, deploy examples
    kernels ...                kernels.py   the kernel cache, export/import, fetch, check, build-here
    bases ... | bootstrap-base bases.py     deb locks and bootstrapped bases
    verify-image REF           here         a pushed image's signature and attestation (build/audit)
    verify-reproducible DIR    build/audit/reproducible.py
    audit IMAGE                audit_command.py  verify in an image this project did not build (build/audit)

Exit codes: 0 ok; 2 invalid spec, incompatible pins or bad arguments; 1 a failed build
(engine, download, compile, checks, registry); 3 refused (kernels import, verify-image).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from build.cli import bases, build_command, kernels
from build.cli.common import EXIT_BAD_SPEC, EXIT_BUILD_FAILED, EXIT_OK, EXIT_REFUSED
from build.errors import BuildFailure, SigningError
from build.kernels.portable import ImportRefused
from contracts import folder_guard
from contracts.schema import InvalidInput


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "SOURCE_DATE_EPOCH" in os.environ:   # refused before any work, not when the labels are rendered
            from build.source_date import parse_epoch

            parse_epoch(os.environ["SOURCE_DATE_EPOCH"])
        if argv and argv[0] == "bootstrap-base":
            return bases.bootstrap_base(argv[1:])
        if argv and argv[0] == "kernels":
            return kernels.main(argv[1:])
        if argv and argv[0] == "bases":
            return bases.main(argv[1:])
        if argv and argv[0] == "verify-image":
            return _verify_image(argv[1:])
        if argv and argv[0] == "audit":
            from build.cli import audit_command

            return audit_command.main(argv[1:])
        if argv and argv[0] == "verify-reproducible":
            from build.audit.reproducible import main as verify_reproducible

            return verify_reproducible(argv[1:])
        return build_command.main(argv)
    except InvalidInput as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_BAD_SPEC
    except folder_guard.UnsafeFolder as exc:
        print(f"error: {exc}\n    fix: {exc.fix}", file=sys.stderr)
        return EXIT_BAD_SPEC
    except SigningError as exc:
        print(f"error: {exc}\n    fix: {exc.fix}", file=sys.stderr)
        return EXIT_BAD_SPEC
    except ImportRefused as exc:
        print(f"error: {exc}\n    fix: {exc.fix}", file=sys.stderr)
        return EXIT_REFUSED
    except BuildFailure as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_BUILD_FAILED
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was kept (cache entries publish atomically)", file=sys.stderr)
        return 130


def _verify_image(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m build verify-image",
                                description="Check a pushed image's signature, provenance attestation and lock "
                                            "label against a public key. Exit 0 verified, 3 refused.")
    p.add_argument("reference", metavar="REF", help="REGISTRY/REPO@sha256:... (or REGISTRY/REPO:TAG, resolved now)")
    p.add_argument("--key", type=Path, required=True, help="the signer's P-256 public key (PEM)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from build import signing
    from build.audit.image_signature import render, verify_image

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
