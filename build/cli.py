"""`python -m build`: a thin CLI over the build library.

    python -m build images/<name>                 build the image end to end
    python -m build images/<name> --plan [--json] print the resolved plan, build nothing
    python -m build images/<name> --render DIR    write the build context, build nothing
    python -m build bootstrap-base images/_bases/<base>
    python -m build kernels list | export DIR | import DIR

Exit codes: 0 ok; 2 invalid spec or incompatible pins; 1 a failed build (engine,
download, compile, checks).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from build.cache import CacheLayout, default_cache_root
from build.errors import BuildFailure, Problems, SpecErrors
from build.log import EventLog

EXIT_OK, EXIT_BUILD_FAILED, EXIT_BAD_SPEC = 0, 1, 2

EPILOG = """\
commands:
  IMAGE_DIR                     build images/<name> (bootstrap bases if needed, fill the wheelhouse,
                                compile or reuse kernels, render, build, check, tag <name>:<plan-key>)
  IMAGE_DIR --kernels-only      only compile/check the plan's kernels into the cache
  bootstrap-base BASE_DIR       debootstrap + docker import a base from images/_bases/<base>/base.yaml
  kernels list                  list the kernel wheel cache
  kernels export DIR            copy every cache entry to DIR (for another machine)
  kernels import DIR            import entries from DIR, verifying each wheel's sha256
  kernels check WHEEL --image TAG --kernel NAME
                                import a kernel wheel beside that image's torch (ABI + entry points)

environment:
  FTIMAGE_CACHE                 cache root (default ~/.cache/ftimage)
  SOURCE_DATE_EPOCH             timestamp for labels, SBOM and context mtimes (default: HEAD's commit time)
  DOCKER_HOST                   the Docker engine to use

exit codes: 0 ok, 1 build failed, 2 invalid spec or incompatible pins
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
                      help="compile (or find in the cache) and check the plan's kernels, build no image; "
                           "e.g. on a big builder machine before `kernels export`")
    p.add_argument("--json", action="store_true", help="with --plan or a build: print JSON instead of a table")
    p.add_argument("--json-logs", action="store_true", help="progress as JSON lines on stderr")
    p.add_argument("--manifest", type=Path, default=None, help="kernels manifest (default: ./kernels_manifest.yaml)")
    p.add_argument("--out", type=Path, default=None, help="output folder for context, lock, SBOM and report "
                   "(default: out/<name>)")
    p.add_argument("--cache", type=Path, default=None, help="cache root (default: $FTIMAGE_CACHE or ~/.cache/ftimage)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "bootstrap-base":
            return _bootstrap_base(argv[1:])
        if argv and argv[0] == "kernels":
            return _kernels(argv[1:])
        return _image(argv)
    except SpecErrors as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_BAD_SPEC
    except BuildFailure as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_BUILD_FAILED
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was kept (cache entries publish atomically)", file=sys.stderr)
        return 130


def _cache(path: Path | None) -> CacheLayout:
    return CacheLayout(path or default_cache_root())


def _image(argv: list[str]) -> int:
    args = _image_parser().parse_args(argv)
    from build.resolve import load_plan
    from build.spec import MANIFEST_PATH

    plan = load_plan(Path(args.image_dir), args.manifest or MANIFEST_PATH)
    cache = _cache(args.cache)
    log = EventLog(json_lines=args.json_logs)
    if args.plan:
        if args.json:
            print(plan.to_json(), end="")
        else:
            from build.kernels import expected_costs
            from build.plan_view import render_plan
            print(render_plan(plan, expected_costs(plan, cache)))
        return EXIT_OK
    if args.render:
        from build.context import render_context
        from build.wheelhouse import fill_wheelhouse
        resolution = fill_wheelhouse(plan, cache, log)
        context = render_context(plan, args.render, wheels=resolution.wheels, cache=cache)
        print(f"rendered {context.files} files into {args.render} (context sha256 {context.digest[:16]})")
        print("note: compiled kernel wheels are added by a full build; bases are named, not bootstrapped")
        return EXIT_OK
    if args.kernels_only:
        return _kernels_only(plan, cache, log, as_json=args.json)
    from build.pipeline import build_image
    out_dir = args.out or Path("out") / plan.spec.name
    report = build_image(plan, cache=cache, out_dir=out_dir, log=log)
    print(report.to_json() if args.json else report.render(), end="\n")
    return EXIT_OK


def _kernels_only(plan, cache: CacheLayout, log: EventLog, *, as_json: bool) -> int:
    from build.bootstrap import ensure_base
    from build.engine import Engine
    from build.kernels import provide_kernels
    from build.plan_view import table

    engine = Engine.connect()
    base = ensure_base(plan.spec.builder_base, engine, cache, log)
    provided = provide_kernels(plan, cache=cache, engine=engine, log=log, builder_base=base.ref)
    rows = [{"kernel": w.name, "key": w.key, "wheel": w.filename, "sha256": w.sha256, "archs": list(w.archs),
             "cache": provided.states[w.name]} for w in provided.wheels]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(table([[r["kernel"], r["key"][:16], r["wheel"], ",".join(r["archs"]) or "-", r["cache"]] for r in rows],
                    ["KERNEL", "KEY", "WHEEL", "SASS", "CACHE"]))
    return EXIT_OK


def _kernels_check(args) -> int:
    from build.engine import Engine
    from build.kernels import check_wheel_in_image
    from build.spec import MANIFEST_PATH, load_manifest

    manifest = load_manifest(args.manifest or MANIFEST_PATH)
    kernel = manifest.kernels.get(args.kernel)
    if kernel is None:
        raise BuildFailure(f"unknown kernel {args.kernel!r}", f"use one of: {', '.join(sorted(manifest.kernels))}")
    if not args.wheel.is_file():
        raise BuildFailure(f"no wheel at {args.wheel}", "pass the path of a kernel wheel (see `kernels list`)")
    rows = check_wheel_in_image(args.wheel, kernel, engine=Engine.connect(), image=args.image, log=EventLog())
    print(f"{len(rows)} checks passed")
    return EXIT_OK


def _bootstrap_base(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m build bootstrap-base",
                                description="Build a base image locally with debootstrap and docker import "
                                            "(idempotent: a base with the same spec hash is reused).")
    p.add_argument("base_dir", type=Path, help="e.g. images/_bases/debian-bookworm")
    p.add_argument("--json-logs", action="store_true")
    p.add_argument("--cache", type=Path, default=None)
    args = p.parse_args(argv)
    from build.bootstrap import bootstrap
    from build.engine import Engine
    from build.spec import load_bootstrap_base

    problems = Problems()
    base = load_bootstrap_base(args.base_dir, problems)
    problems.raise_if_any()
    result = bootstrap(base, Engine.connect(), _cache(args.cache), EventLog(json_lines=args.json_logs))
    print(json.dumps({"ref": result.ref, "id": result.id, "reused": result.reused}))
    return EXIT_OK


def _kernels(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m build kernels", description="Manage the kernel wheel cache.")
    p.add_argument("--cache", type=Path, default=None)
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list cache entries")
    sub.add_parser("export", help="copy entries to DIR").add_argument("directory", type=Path)
    sub.add_parser("import", help="import entries from DIR, verifying hashes").add_argument("directory", type=Path)
    check = sub.add_parser("check", help="run the import/ABI and entry-point checks of a kernel wheel inside an "
                                         "image (beside that image's torch)")
    check.add_argument("wheel", type=Path)
    check.add_argument("--image", required=True, help="image tag whose torch the wheel must load against")
    check.add_argument("--kernel", required=True, help="kernel name in the manifest (for its entry points)")
    check.add_argument("--manifest", type=Path, default=None)
    args = p.parse_args(argv)
    if args.action == "check":
        return _kernels_check(args)
    from build.kernels.store import KernelStore

    store = KernelStore(_cache(args.cache))
    if args.action == "list":
        for entry in store.entries():
            m = entry.meta
            print(f"{entry.key[:16]}  {m['kernel']} {m['version']}  {m['wheel']}  archs={','.join(m['archs']['sass'])}"
                  f"  compiled in {m.get('duration_s', '?')}s")
        return EXIT_OK
    if args.action == "export":
        keys = store.export(args.directory)
        print(f"exported {len(keys)} entries to {args.directory}")
        return EXIT_OK
    imported, rejected = store.import_from(args.directory)
    print(f"imported {len(imported)} entries; rejected {len(rejected)}")
    for key in rejected:
        print(f"  rejected {key}: missing meta.json or wheel sha256 mismatch", file=sys.stderr)
    return EXIT_BUILD_FAILED if rejected else EXIT_OK
