"""`python -m build IMAGE_DIR [--plan | --render DIR | --kernels-only | --deploy-example KIND]
[--push REPOSITORY [--sign KEY] [--check-pull containerd]]`: plan, render, build, push, check and sign one
image."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from build.cli import plan_command, render_command
from build.cli.common import EPILOG, EXIT_OK, add_common_options, open_cache, open_remote
from build.cli.kernels_only_command import kernels_only
from build.errors import SigningError
from build.publish.deploy_examples import TEMPLATES, render_example
from build.publish.pull_check import pull_check_from_args
from build.publish.reference import push_target_from_args
from build.remote_cache.options import add_options as add_remote_options
from build.remote_cache.options import options_from_args
from build.resolve import load_plan
from build.spec import MANIFEST_PATH
from contracts.events import EventLog

DEPLOY_EXAMPLES = tuple(TEMPLATES)


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
    p.add_argument("--check-pull", metavar="containerd[=SOCKET]", help="with --push: pull the pushed digest with "
                   "containerd (its client `ctr`; SOCKET default /run/containerd/containerd.sock) and fail with its "
                   "reason if it refuses the image, before the push is recorded or signed")
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
    """Parse, check every flag before any work (a bad one is exit 2), then hand the mode to its module."""
    args = parser().parse_args(argv)
    push_target = push_target_from_args(args.push, {"--plan": args.plan, "--render": args.render is not None,
                                                    "--kernels-only": args.kernels_only,
                                                    "--deploy-example": bool(args.deploy_example)})
    pull_check = pull_check_from_args(args.check_pull, push=push_target is not None)
    if pull_check is not None:
        push_target = replace(push_target, pull_check=pull_check)
    remote_options = options_from_args(args)
    if args.sign and push_target is None and remote_options is None:
        raise SigningError("--sign signs what --push pushes (or the remote cache's entries), and there is no "
                           "--push or --cache-registry", "add --push REGISTRY/REPO, or drop --sign")
    sign_key = load_signing_key(args.sign) if args.sign else None
    if remote_options is not None:
        remote_options = replace(remote_options, sign_key=sign_key)
    plan = load_plan(Path(args.image_dir), args.manifest or MANIFEST_PATH)
    log = EventLog(json_lines=args.json_logs)
    out_dir = args.out or Path("out") / plan.spec.name
    if args.plan:
        return plan_command.show_plan(plan, cache_root=args.cache, remote_options=remote_options, log=log,
                                      as_json=args.json)
    if args.deploy_example:
        print(render_example(plan, out_dir, args.deploy_example), end="")
        return EXIT_OK
    if args.render:
        return render_command.render(plan, args.render, cache_root=args.cache, log=log, force=args.force)
    cache = open_cache(args.cache, force=args.force)
    remote = open_remote(remote_options, log)
    if args.kernels_only:
        return kernels_only(plan, cache, log, as_json=args.json, remote=remote)
    # the image build's modules (engine, assembler, push) load only when an image is built: the modes
    # above run without them, and --plan stays as quick as the plan itself
    from build.pipeline import build_and_publish

    report = build_and_publish(plan, cache=cache, out_dir=out_dir, log=log, force=args.force,
                               builder=args.builder, remote=remote, push_target=push_target, sign_key=sign_key)
    print(report.to_json() if args.json else report.render(), end="\n")
    return EXIT_OK


def load_signing_key(path: Path):
    """The --sign key (a bad one: exit 2, before any work). `cryptography` loads only when a key is
    given: a host running only --plan or --render may lack it."""
    from build import signing

    return signing.load_private_key(path)
