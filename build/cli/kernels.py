"""`python -m build kernels list|export|import|fetch|check|build-here`: the kernel wheel cache,
moving it between machines, and compiling an image's kernels on this machine (no Docker)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from build.cli.common import EXIT_OK, EXIT_REFUSED, add_common_options, open_cache, open_remote
from build.engine import connect
from build.errors import BuildFailure, SigningError
from build.kernels import check_wheel_in_image, portable
from build.kernels.build_here import build_here
from build.kernels.pinned_sources import fetch_pinned
from build.kernels.store import KernelStore
from build.remote_cache.options import add_options as add_remote_options
from build.remote_cache.options import options_from_args
from build.resolve import load_plan
from build.resolve.this_host import host_arch
from build.spec import MANIFEST_PATH, load_manifest
from contracts import folder_guard
from contracts.events import EventLog


def parser() -> argparse.ArgumentParser:
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
    here.add_argument("--sign", type=Path, metavar="KEY", help="with --cache-registry: sign every kernel entry "
                      "pushed there with this P-256 private key (PEM; cosign's format)")
    add_common_options(here)
    add_remote_options(here)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    log = EventLog(json_lines=args.json_logs)
    if args.action == "check":
        return _check(args, log)
    if args.action == "build-here":
        return _build_here(args, log)
    if args.action == "fetch":
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
    from build import signing  # only for export/import: a bare GPU host has no cryptography

    if args.action == "export":
        key = signing.load_private_key(args.sign) if args.sign else None
        folder_guard.claim(args.directory, folder_guard.OUTPUT_MARKER, what="export folder", option="kernels export",
                     force=args.force)
        keys, skipped = portable.export(store, args.directory, sign_key=key)
        print(f"exported {len(keys)} entries to {args.directory}"
              + (f", manifest signed by {signing.key_id(key)[:23]}..." if key else " (unsigned)"))
        for skipped_key, why in skipped:
            print(f"  skipped {skipped_key[:16]}: {why} (the next build that needs it rebuilds it)", file=sys.stderr)
        return EXIT_OK
    public = signing.load_public_key(args.key) if args.key else None
    # an entry's inputs name its torch by the wheel's sha256: the manifest's toolchains say which version that is
    manifest = load_manifest(args.manifest or MANIFEST_PATH)
    torch_versions = {wheel.sha256: toolchain.torch_version for toolchain in manifest.toolchains.values()
                      for wheel in toolchain.torch_wheels.values()}
    imported, rejected = portable.import_from(store, args.directory, public_key=public,
                                              trust_unsigned=args.trust_unsigned, log=log,
                                              torch_versions=torch_versions)
    print(f"imported {len(imported)} entries; refused {len(rejected)}")
    for key, why in rejected:
        print(f"  refused {key[:64]}: {why}", file=sys.stderr)
    return EXIT_REFUSED if rejected else EXIT_OK


def _check(args, log: EventLog) -> int:
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
    remote_options = options_from_args(args)   # a bad --cache-registry: exit 2, before any work
    if args.sign and remote_options is None:
        raise SigningError("--sign signs the kernel entries pushed to the remote cache, and there is no "
                           "--cache-registry", "add --cache-registry REGISTRY/REPO, or drop --sign")
    if args.sign:
        from build import signing  # only with --sign: a bare GPU host has no cryptography

        remote_options = replace(remote_options, sign_key=signing.load_private_key(args.sign))
    archs = tuple(args.arch)
    if not archs:
        archs = tuple(a for a in [host_arch()] if a)
    if not archs:
        raise BuildFailure("no GPU here to build for", "pass --arch sm_90 (or the arch you will run on)")
    summary = build_here(args.image_dir, manifest_path=args.manifest or MANIFEST_PATH,
                         cache=open_cache(args.cache, force=args.force), out=args.out, archs=archs, log=log,
                         cores=args.cores, install=args.install, lock_path=args.lock, force=args.force,
                         remote=open_remote(remote_options, log))
    print(json.dumps(summary, indent=2, sort_keys=True))
    return EXIT_OK
