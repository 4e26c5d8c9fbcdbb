"""`python -m build audit IMAGE [--json] [--gpus all|N] [--model DIR]`: run verify inside an image
this project did not build (build/audit/foreign_image.py). Exit codes are verify's: 0 pass,
1 warn, 2 fail; an image verify cannot run in (or an engine failure) is 2 with the fix."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from build.audit.foreign_image import AuditRefused, audit_image, parse_gpus, validate_reference
from build.engine import connect
from build.errors import BuildFailure

EXIT_FAIL = 2   # verify's "fail": nothing proven


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m build audit",
        description="Prove, inside any local image with Python >= 3.10, torch and transformers, which kernels "
                    "transformers really dispatches to (forward and backward), whether its kernel extensions match "
                    "its torch (ABI, CUDA, archs) and whether packed documents stay isolated: this checkout's verify, "
                    "mounted read-only, run with the image's own Python and user, no network, no lock. "
                    "Exit code: 0 pass, 1 warn, 2 fail (or refused).")
    p.add_argument("image", metavar="IMAGE", help="a local image: [registry/]repo[:tag][@sha256:...] or an image ID")
    p.add_argument("--json", action="store_true", help="print verify's JSON report instead of the table")
    p.add_argument("--gpus", metavar="all|N", help="pass GPUs through (docker --gpus); default none")
    p.add_argument("--model", type=Path, metavar="DIR", help="the model to be trained (its config.json), mounted "
                   "read-only")
    p.add_argument("--families", metavar="A,B|all", help="the model families to prove (default: qwen3_5_text; `all`: "
                   "every family this checkout knows); with --model, the one its config.json names")
    p.add_argument("--timeout", type=float, default=3600, help="seconds verify may run (default 3600)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        validate_reference(args.image)     # hostile input: checked before the engine is reached
        gpus = parse_gpus(args.gpus)
        return audit_image(connect(), args.image, json_report=args.json, gpus=gpus, model=args.model,
                           timeout=args.timeout, families=args.families)
    except (AuditRefused, BuildFailure) as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_FAIL
