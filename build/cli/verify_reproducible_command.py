"""`python -m build verify-reproducible IMAGE_DIR [--work DIR] [--push-to REPO] [--json]`: build the
image twice from fresh clones and compare (build/audit/reproducible.py). Exit 0 when both builds
are the same image, 1 when they differ, 2 for a bad argument."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from build.audit import reproducible
from build.cli.common import EXIT_BUILD_FAILED, EXIT_OK
from build.publish.reference import parse_push_target


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m build verify-reproducible",
                                description=reproducible.__doc__.split("\n\n")[0])
    p.add_argument("image_dir", type=Path, help="an image folder of this checkout, e.g. images/smoke")
    p.add_argument("--work", type=Path, help="where the clones, caches and outputs go (default: a temporary "
                   "folder, removed afterwards)")
    p.add_argument("--push-to", metavar="REPOSITORY", help="also push both builds to REGISTRY/REPO (tags repro-a "
                   "and repro-b) and compare the registry's digests")
    p.add_argument("--kernels-from", type=Path, metavar="CACHE", help="share this cache's compiled kernels with "
                   "both builds (hard links): compiling kernels twice is slow and nvcc's output is out of scope")
    p.add_argument("--inputs-from", type=Path, metavar="CACHE", help="share this cache's downloads (wheels, "
                   "kernel sources, .debs; all pinned by sha256) with both builds: the resolution, the base, every "
                   "layer and the image are still made from scratch twice")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    reproducible.check_image_dir(args.image_dir)   # a bad folder or --push-to: exit 2 before any work
    target = parse_push_target(args.push_to) if args.push_to else None
    comparison, results = reproducible.verify_reproducible(args.image_dir, work=args.work, push_to=target,
                                                           kernels_from=args.kernels_from,
                                                           inputs_from=args.inputs_from)
    if args.json:
        print(json.dumps({"reproducible": comparison.same, "builds": [asdict(r) for r in results],
                          "rows": [{"what": w, "a": a, "b": b, "same": s} for w, a, b, s in comparison.rows],
                          "first_differing_layer": comparison.first_differing_layer,
                          "differing_paths": comparison.differing_paths}, indent=2))
    else:
        print(comparison.render(*results))
    return EXIT_OK if comparison.same else EXIT_BUILD_FAILED
