"""`python -m build IMAGE_DIR [--plan | --render DIR | --kernels-only | --deploy-example KIND]
[--push REPOSITORY [--sign KEY]]`: plan, render, build, push and sign one image."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from build.cache import CacheLayout
from build.cli.common import EPILOG, EXIT_OK, add_common_options, open_cache, open_remote
from build.context import render_target
from build.errors import SigningError
from build.remote_cache.options import add_options as add_remote_options
from build.remote_cache.options import options_from_args
from contracts.events import EventLog

# the keys of build.publish.deploy_examples.TEMPLATES (imported only when one is rendered)
DEPLOY_EXAMPLES = ("k8s-runtime", "k8s-trainjob", "k8s-trainjob-trl", "k8s", "slurm")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m build", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Build a hardened fine-tuning image from images/<name>/image.yaml and kernels_manifest.yaml.")
    p.add_argument("image_dir", metavar="IMAGE_DIR", help="image folder, e.g. images/qwen27b")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="print the resolved build plan and exit")
    mode.add_argument("--render", metavar="DIR", type=Path, help="write the build context to DIR and exit")
    mode.add_argument("--kernels-only", action="store_true",
                      help="compile (or find in the cache) and check the plan's kernels, build no image")
    mode.add_argument("--deploy-example", choices=DEPLOY_EXAMPLES,
                      help="render a deploy example for the pushed image (after --push): k8s-runtime, "
                           "k8s-trainjob, k8s-trainjob-trl (Kubeflow Trainer v2), k8s (legacy PyTorchJob), slurm")
    p.add_argument("--push", metavar="REPOSITORY", help="after the build, push to REGISTRY/REPO (e.g. "
                   "registry.example.com:5000/team/qwen27b) and record the digest")
    p.add_argument("--sign", metavar="KEY", type=Path, help="with --push: sign the pushed digest and attest its "
                   "provenance with this ECDSA P-256 private key (PEM; cosign's format); with --cache-registry: "
                   "sign every entry pushed to the remote cache")
    p.add_argument("--json", action="store_true", help="with --plan or a build: print JSON instead of a table")
    p.add_argument("--builder", choices=("oci", "dockerfile"), default="oci",
                   help="oci (default): assemble the image in Python, reproducibly; dockerfile: the engine's "
                        "classic builder, for an engine on another host")
    p.add_argument("--out", type=Path, default=None, help="output folder for context, lock, SBOM and report "
                   "(default: out/<name>)")
    add_common_options(p)
    add_remote_options(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from build.publish.push import push_target_from_args

    # a bad --push is exit 2 before any plan or build work
    push_target = push_target_from_args(args.push, {"--plan": args.plan, "--render": args.render is not None,
                                                    "--kernels-only": args.kernels_only,
                                                    "--deploy-example": bool(args.deploy_example)})
    remote_options = options_from_args(args)   # a bad --cache-registry: exit 2, before any work
    if args.sign and push_target is None and remote_options is None:
        raise SigningError("--sign signs what --push pushes (or the remote cache's entries), and there is no "
                           "--push or --cache-registry", "add --push REGISTRY/REPO, or drop --sign")
    from build import signing

    sign_key = signing.load_private_key(args.sign) if args.sign else None   # a bad key: exit 2, before any work
    if remote_options is not None:
        from dataclasses import replace

        remote_options = replace(remote_options, sign_key=sign_key)
    from build.resolve import load_plan
    from build.spec import MANIFEST_PATH

    plan = load_plan(Path(args.image_dir), args.manifest or MANIFEST_PATH)
    log = EventLog(json_lines=args.json_logs)
    if args.plan:
        from build.cli.plan_layers import engine_for_plan, layer_rows, render_rows
        from build.kernels import expected_costs

        cache = open_cache(args.cache, write=False)
        remote = open_remote(remote_options, log)
        costs = expected_costs(plan, cache, remote.kernel_state if remote else None)
        engine, no_engine = engine_for_plan()     # read only: the runtime base's layers, if it is there
        layers = layer_rows(plan, cache, engine=engine, engine_problem=no_engine,
                            remote_state=remote.layer_state if remote else None)
        if args.json:
            data = json.loads(plan.to_json())
            for kernel in data.get("kernels", []):   # what the table shows: cache state and compile cost
                state, cost = costs.get(kernel.get("key"), ("unknown", "unknown"))
                kernel["cache"] = {"state": state.split(":")[0].split(" (")[0].lower(), "detail": state,
                                   "expected_compile": cost}
            data["layers"] = layers
            if remote is not None:
                data["remote_cache"] = remote_options.describe()
            print(json.dumps(data, indent=2, sort_keys=True))
        else:
            from build.cli.plan_view import render_plan
            print(render_plan(plan, costs))
            print(f"\n{render_rows(layers)}")
            if remote is not None:
                print(f"remote cache {remote_options.describe()}")
        return EXIT_OK
    out_dir = args.out or Path("out") / plan.spec.name
    if args.deploy_example:
        from build.publish.deploy_examples import render_example
        print(render_example(plan, out_dir, args.deploy_example), end="")
        return EXIT_OK
    if args.render:
        render_target.check_render_target(args.render, force=args.force)
    cache = open_cache(args.cache, force=args.force)
    if args.render:
        from build.context.render import render_context
        from build.wheelhouse import fill_wheelhouse

        resolution = fill_wheelhouse(plan, cache, log)
        context = render_context(plan, args.render, wheels=resolution.wheels, cache=cache, force=args.force)
        print(f"rendered {context.files} files into {args.render} (context sha256 {context.digest[:16]})")
        print("note: compiled kernel wheels are added by a full build; bases are named, not bootstrapped")
        return EXIT_OK
    remote = open_remote(remote_options, log)
    if args.kernels_only:
        return kernels_only(plan, cache, log, as_json=args.json, remote=remote)
    from build.pipeline import build_image

    report = build_image(plan, cache=cache, out_dir=out_dir, log=log, force=args.force, builder=args.builder,
                         remote=remote)
    if push_target is not None:
        from build.publish.push import push_image
        push_image(report, push_target, out_dir=out_dir, log=log, sign_key=sign_key)
    if remote is not None:
        from contracts import atomic

        same_registry = push_target is not None and push_target.registry == remote_options.registry
        remote.flush(mount_from=push_target.path if same_registry else "")
        report.remote_cache = remote.record()
        atomic.write_text(out_dir / "build-report.json", report.to_json())
    print(report.to_json() if args.json else report.render(), end="\n")
    return EXIT_OK


def kernels_only(plan, cache: CacheLayout, log: EventLog, *, as_json: bool, remote=None) -> int:
    from build.base.bootstrap import ensure_base
    from build.engine import connect
    from build.kernels import provide_kernels
    from contracts.table import render_table

    engine = connect()
    # the builder base is bootstrapped only when a kernel has to be compiled (not on cache hits)
    provided = provide_kernels(plan, cache=cache, engine=engine, log=log,
                               builder_base=lambda: ensure_base(plan.spec.builder_base, engine, cache, log).ref,
                               remote=remote.fetch_kernel if remote else None)
    if remote is not None:
        for entry in provided.entries.values():
            remote.queue_kernel(entry)
        remote.flush()
    rows = [{"kernel": w.name, "key": w.key, "wheel": w.filename, "sha256": w.sha256, "archs": list(w.archs),
             "cache": provided.states[w.name]} for w in provided.wheels]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_table([[r["kernel"], r["key"][:16], r["wheel"], ",".join(r["archs"]) or "-", r["cache"]]
                            for r in rows], ["KERNEL", "KEY", "WHEEL", "SASS", "CACHE"]))
    return EXIT_OK
