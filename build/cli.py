"""`python -m build`: a thin CLI over the build library (see EPILOG for the commands).

Exit codes: 0 ok; 2 invalid spec, incompatible pins or bad arguments; 1 a failed build
(engine, download, compile, checks, registry).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from build import outdir
from build.cache import CacheLayout
from build.cli_common import EXIT_BAD_SPEC, EXIT_BUILD_FAILED, EXIT_OK, EXIT_REFUSED, add_common_options, open_cache
from build.errors import BuildFailure, SigningError
from build.kernels.portable import ImportRefused
from contracts.events import EventLog
from contracts.schema import InvalidInput

EPILOG = """\
commands:
  IMAGE_DIR                     build images/<name>: bootstrap bases if needed, fill the wheelhouse,
                                compile or reuse kernels, render, build, check, tag <name>:<plan-key>
  IMAGE_DIR --plan [--json]     the resolved plan: toolchain, archs, each kernel's key, cache state,
                                specialisation and expected compile cost (nothing is built)
  IMAGE_DIR --render DIR        write the build context to DIR (a new or empty folder)
  IMAGE_DIR --kernels-only      only compile/check the plan's kernels into the cache
  IMAGE_DIR --push REPOSITORY   build, then push to REGISTRY/REPO and record the digest
  IMAGE_DIR --push REPOSITORY --sign KEY
                                also push a cosign signature and a SLSA provenance attestation
  verify-reproducible IMAGE_DIR build twice from two fresh clones (fresh caches, another umask, time
                                zone and host name) and compare image ID, diffIDs and manifest digest
  verify-image REF --key PUB    check an image in a registry: signature, attestation, lock label
                                (exit 3 if any is refused)
  IMAGE_DIR --deploy-example {k8s,slurm}
                                render a deploy example for the pushed image, pinned by digest
  bootstrap-base BASE_DIR       debootstrap a base from images/_bases/<base>/base.yaml (from its deb lock)
  bases update BASE_DIR         re-pin the base's .debs from the mirror's signed index (a reviewed change)
  bases export DIR | import DIR carry the locked .debs to a machine with no mirror (import re-hashes)
  kernels list                  list the kernel wheel cache (a corrupt entry is named)
  kernels export DIR [--sign KEY]   copy every cache entry to DIR with a manifest (signed: cosign format)
  kernels import DIR --key PUB      import entries from DIR, proving each one (or --trust-unsigned, logged)
  kernels fetch IMAGE_DIR       download the image's pinned sources into the cache (to carry offline)
  kernels check WHEEL --image TAG --kernel NAME
                                import a kernel wheel beside that image's torch (ABI + entry points)
  kernels build-here IMAGE_DIR [--arch sm_90] [--out DIR] [--install DIR] [--lock FILE]
                                compile and check the image's kernels on THIS machine, without Docker,
                                for its own Python, torch and GPU

environment:
  FTIMAGE_CACHE                 cache root (default ~/.cache/ftimage)
  SOURCE_DATE_EPOCH             timestamp for labels, SBOM and context mtimes (default: HEAD's commit time)
  DOCKER_HOST                   the Docker engine to use

exit codes: 0 ok, 1 build failed, 2 invalid spec or arguments, 3 refused (kernels import, verify-image)
"""


def _image_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m build", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Build a hardened fine-tuning image from images/<name>/image.yaml and kernels_manifest.yaml.")
    p.add_argument("image_dir", metavar="IMAGE_DIR", help="image folder, e.g. images/qwen27b")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="print the resolved build plan and exit")
    mode.add_argument("--render", metavar="DIR", type=Path, help="write the build context to DIR and exit")
    mode.add_argument("--kernels-only", action="store_true",
                      help="compile (or find in the cache) and check the plan's kernels, build no image")
    mode.add_argument("--deploy-example", choices=("k8s", "slurm"),
                      help="render a deploy example for the pushed image (after --push)")
    p.add_argument("--push", metavar="REPOSITORY", help="after the build, push to REGISTRY/REPO (e.g. "
                   "registry.example.com:5000/team/qwen27b) and record the digest")
    p.add_argument("--sign", metavar="KEY", type=Path, help="with --push: sign the pushed digest and attest its "
                   "provenance with this ECDSA P-256 private key (PEM; cosign's format)")
    p.add_argument("--json", action="store_true", help="with --plan or a build: print JSON instead of a table")
    p.add_argument("--builder", choices=("oci", "dockerfile"), default="oci",
                   help="oci (default): assemble the image in Python, reproducibly; dockerfile: the engine's "
                        "classic builder, for an engine on another host")
    p.add_argument("--out", type=Path, default=None, help="output folder for context, lock, SBOM and report "
                   "(default: out/<name>)")
    add_common_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "SOURCE_DATE_EPOCH" in os.environ:   # refused before any work, not when the labels are rendered
            from build.context.render import parse_epoch

            parse_epoch(os.environ["SOURCE_DATE_EPOCH"])
        if argv and argv[0] == "bootstrap-base":
            return _bootstrap_base(argv[1:])
        if argv and argv[0] == "kernels":
            return _kernels(argv[1:])
        if argv and argv[0] == "bases":
            from build.cli_bases import main as bases

            return bases(argv[1:])
        if argv and argv[0] == "verify-image":
            return _verify_image(argv[1:])
        if argv and argv[0] == "verify-reproducible":
            from build.reproducible import main as verify_reproducible

            return verify_reproducible(argv[1:])
        return _image(argv)
    except InvalidInput as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_BAD_SPEC
    except outdir.UnsafeDirectory as exc:
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


def _image(argv: list[str]) -> int:
    args = _image_parser().parse_args(argv)
    from build.push import push_target_from_args

    # a bad --push is exit 2 before any plan or build work
    push_target = push_target_from_args(args.push, {"--plan": args.plan, "--render": args.render is not None,
                                                    "--kernels-only": args.kernels_only,
                                                    "--deploy-example": bool(args.deploy_example)})
    if args.sign and push_target is None:
        raise SigningError("--sign signs what --push pushes, and there is no --push",
                           "add --push REGISTRY/REPO, or drop --sign")
    from build import signing

    sign_key = signing.load_private_key(args.sign) if args.sign else None   # a bad key: exit 2, before any work
    from build.resolve import load_plan
    from build.spec import MANIFEST_PATH

    plan = load_plan(Path(args.image_dir), args.manifest or MANIFEST_PATH)
    log = EventLog(json_lines=args.json_logs)
    if args.plan:
        from build.kernels import expected_costs

        cache = open_cache(args.cache, write=False)
        costs = expected_costs(plan, cache)
        if args.json:
            data = json.loads(plan.to_json())
            for kernel in data.get("kernels", []):   # what the table shows: cache state and compile cost
                state, cost = costs.get(kernel.get("key"), ("unknown", "unknown"))
                kernel["cache"] = {"state": state.split(":")[0].lower(), "detail": state, "expected_compile": cost}
            print(json.dumps(data, indent=2, sort_keys=True))
        else:
            from build.plan_view import render_plan
            print(render_plan(plan, costs))
        return EXIT_OK
    out_dir = args.out or Path("out") / plan.spec.name
    if args.deploy_example:
        from build.deploy import render_example
        print(render_example(plan, out_dir, args.deploy_example), end="")
        return EXIT_OK
    if args.render:
        outdir.check_render_target(args.render, force=args.force)
    cache = open_cache(args.cache, force=args.force)
    if args.render:
        from build.context.render import render_context
        from build.wheelhouse import fill_wheelhouse
        resolution = fill_wheelhouse(plan, cache, log)
        context = render_context(plan, args.render, wheels=resolution.wheels, cache=cache, force=args.force)
        print(f"rendered {context.files} files into {args.render} (context sha256 {context.digest[:16]})")
        print("note: compiled kernel wheels are added by a full build; bases are named, not bootstrapped")
        return EXIT_OK
    if args.kernels_only:
        return _kernels_only(plan, cache, log, as_json=args.json)
    from build.pipeline import build_image

    report = build_image(plan, cache=cache, out_dir=out_dir, log=log, force=args.force, builder=args.builder)
    if push_target is not None:
        from build.push import push_image
        push_image(report, push_target, out_dir=out_dir, log=log, sign_key=sign_key)
    print(report.to_json() if args.json else report.render(), end="\n")
    return EXIT_OK


def _verify_image(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m build verify-image",
                                description="Check a pushed image's signature, provenance attestation and lock "
                                            "label against a public key. Exit 0 verified, 3 refused.")
    p.add_argument("reference", metavar="REF", help="REGISTRY/REPO@sha256:... (or REGISTRY/REPO:TAG, resolved now)")
    p.add_argument("--key", type=Path, required=True, help="the signer's P-256 public key (PEM)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from build import signing
    from build.verify_image import render, verify_image

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


def _kernels_only(plan, cache: CacheLayout, log: EventLog, *, as_json: bool) -> int:
    from build.bootstrap import ensure_base
    from build.engine import connect
    from build.kernels import provide_kernels
    from contracts.table import render_table

    engine = connect()
    base = ensure_base(plan.spec.builder_base, engine, cache, log)
    provided = provide_kernels(plan, cache=cache, engine=engine, log=log, builder_base=base.ref)
    rows = [{"kernel": w.name, "key": w.key, "wheel": w.filename, "sha256": w.sha256, "archs": list(w.archs),
             "cache": provided.states[w.name]} for w in provided.wheels]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_table([[r["kernel"], r["key"][:16], r["wheel"], ",".join(r["archs"]) or "-", r["cache"]]
                            for r in rows], ["KERNEL", "KEY", "WHEEL", "SASS", "CACHE"]))
    return EXIT_OK


def _bootstrap_base(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m build bootstrap-base",
                                description="Build a base image locally with debootstrap and docker import "
                                            "(idempotent: a base with the same spec hash is reused).")
    p.add_argument("base_dir", type=Path, help="e.g. images/_bases/debian-bookworm")
    add_common_options(p)
    args = p.parse_args(argv)
    from build.bootstrap import bootstrap
    from build.engine import connect
    from build.spec import SpecErrors, load_bootstrap_base
    from contracts.schema import Problems

    problems = Problems()
    base = load_bootstrap_base(args.base_dir, problems)
    problems.raise_if_any(SpecErrors)
    result = bootstrap(base, connect(), open_cache(args.cache, force=args.force), EventLog(json_lines=args.json_logs))
    print(json.dumps({"ref": result.ref, "id": result.id, "reused": result.reused}))
    return EXIT_OK


def _kernels_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m build kernels", description="Manage and build kernel wheels.")
    sub = p.add_subparsers(dest="action", required=True)
    add_common_options(sub.add_parser("list", help="list cache entries"))
    export = sub.add_parser("export", help="copy entries to DIR, with a manifest (signed with --sign)")
    export.add_argument("directory", type=Path)
    export.add_argument("--sign", type=Path, metavar="KEY", help="sign the export's manifest with this P-256 private "
                        "key (PEM; cosign's format)")
    add_common_options(export)
    imp = sub.add_parser("import", help="import entries from DIR, proving each one (exit 3 if any is refused)")
    imp.add_argument("directory", type=Path)
    trust = imp.add_mutually_exclusive_group()
    trust.add_argument("--key", type=Path, metavar="PUB", help="the exporter's public key: the manifest's signature "
                       "must verify with it")
    trust.add_argument("--trust-unsigned", action="store_true", help="import without a signature (logged): each "
                       "entry is checked against itself only")
    add_common_options(imp)
    fetch = sub.add_parser("fetch", help="download an image's pinned kernel sources into the cache")
    fetch.add_argument("image_dir", type=Path)
    add_common_options(fetch)
    check = sub.add_parser("check", help="run the import/ABI and entry-point checks of a kernel wheel inside an "
                                         "image (beside that image's torch)")
    check.add_argument("wheel", type=Path)
    check.add_argument("--image", required=True, help="image tag whose torch the wheel must load against")
    check.add_argument("--kernel", required=True, help="kernel name in the manifest (for its entry points)")
    add_common_options(check)
    here = sub.add_parser("build-here", help="compile and check an image's kernels on this machine (no Docker)")
    here.add_argument("image_dir", type=Path)
    here.add_argument("--arch", action="append", default=[], help="target arch (default: this machine's GPU)")
    here.add_argument("--out", type=Path, default=Path("out/kernels-here"))
    here.add_argument("--install", type=Path, help="also install the wheels into this --target folder")
    here.add_argument("--lock", type=Path, help="write a build lock for this machine to FILE")
    here.add_argument("--cores", type=int, default=None, help="compile jobs in all (default: every core)")
    add_common_options(here)
    return p


def _kernels(argv: list[str]) -> int:
    args = _kernels_parser().parse_args(argv)
    log = EventLog(json_lines=args.json_logs)
    if args.action == "check":
        return _kernels_check(args, log)
    if args.action == "build-here":
        return _build_here(args, log)
    from build.kernels.store import KernelStore

    if args.action == "fetch":
        from build.resolve import load_plan
        from build.sources import fetch_pinned
        from build.spec import MANIFEST_PATH

        plan = load_plan(args.image_dir, args.manifest or MANIFEST_PATH)
        cache = open_cache(args.cache, force=args.force)
        for kernel in plan.kernels:
            for source in kernel.sources:
                print(fetch_pinned(source, cache, log))
        return EXIT_OK
    store = KernelStore(open_cache(args.cache, force=args.force, write=args.action != "list"))
    if args.action == "list":
        for state in store.states():
            if state.entry is None:
                print(f"{state.key[:16]}  CORRUPT: {state.detail} (the next build replaces it)")
                continue
            m = state.entry.meta
            print(f"{state.key[:16]}  {m['kernel']} {m['version']}  {m['wheel']}  archs={','.join(m['archs']['sass'])}"
                  f"  compiled in {m.get('duration_s', '?')}s")
        return EXIT_OK
    from build import signing
    from build.kernels import portable

    if args.action == "export":
        key = signing.load_private_key(args.sign) if args.sign else None
        outdir.claim(args.directory, outdir.OUTPUT_MARKER, what="export folder", option="kernels export",
                     force=args.force)
        keys, skipped = portable.export(store, args.directory, sign_key=key)
        print(f"exported {len(keys)} entries to {args.directory}"
              + (f", manifest signed by {signing.key_id(key)[:23]}..." if key else " (unsigned)"))
        for skipped_key, why in skipped:
            print(f"  skipped {skipped_key[:16]}: {why} (the next build that needs it rebuilds it)", file=sys.stderr)
        return EXIT_OK
    public = signing.load_public_key(args.key) if args.key else None
    imported, rejected = portable.import_from(store, args.directory, public_key=public,
                                              trust_unsigned=args.trust_unsigned, log=log)
    print(f"imported {len(imported)} entries; refused {len(rejected)}")
    for key, why in rejected:
        print(f"  refused {key[:64]}: {why}", file=sys.stderr)
    return EXIT_REFUSED if rejected else EXIT_OK


def _kernels_check(args, log: EventLog) -> int:
    from build.engine import connect
    from build.kernels import check_wheel_in_image
    from build.spec import MANIFEST_PATH, load_manifest

    manifest = load_manifest(args.manifest or MANIFEST_PATH)
    kernel = manifest.kernels.get(args.kernel)
    if kernel is None:
        raise BuildFailure(f"unknown kernel {args.kernel!r}", f"use one of: {', '.join(sorted(manifest.kernels))}")
    if not args.wheel.is_file():
        raise BuildFailure(f"no wheel at {args.wheel}", "pass the path of a kernel wheel (see `kernels list`)")
    rows = check_wheel_in_image(args.wheel, kernel, engine=connect(), image=args.image, log=log)
    print(f"{len(rows)} checks passed")
    return EXIT_OK


def _build_here(args, log: EventLog) -> int:
    from build.kernels.host import build_here
    from build.resolve.host import host_arch
    from build.spec import MANIFEST_PATH

    archs = tuple(args.arch) or tuple(a for a in [host_arch()] if a)
    if not archs:
        raise BuildFailure("no GPU here to build for", "pass --arch sm_90 (or the arch you will run on)")
    summary = build_here(args.image_dir, manifest_path=args.manifest or MANIFEST_PATH,
                         cache=open_cache(args.cache, force=args.force), out=args.out, archs=archs, log=log,
                         cores=args.cores, install=args.install, lock_path=args.lock, force=args.force)
    print(json.dumps(summary, indent=2, sort_keys=True))
    return EXIT_OK
