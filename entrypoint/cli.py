"""`python -m entrypoint` (the image ENTRYPOINT): finetune | verify | info | shell, and
any other argv exec'd as a plain command so the image doubles as a cluster base image
(`docker run IMAGE id -u`, `docker run IMAGE torchrun ...`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

SUBCOMMANDS = ("finetune", "verify", "info", "shell")
EXIT_USAGE = 2


def _err(message: str, fix: str = "") -> None:
    print(f"error: {message}", file=sys.stderr)
    if fix:
        print(f"  fix: {fix}", file=sys.stderr)


def _log(message: str) -> None:
    # progress goes to stderr so stdout stays machine-readable (--dry-run prints JSON)
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip() + "\n\nusage: python -m entrypoint {finetune,verify,info,shell} ... | COMMAND [ARGS]\n"
              "  finetune --config CONFIG.yaml [--allow-fallback] [KEY=VALUE ...]\n"
              "  verify [verify args]     run the preflight checks (python -m verify)\n"
              "  info [--json]            summarize the build lock\n"
              "  shell [ARGS]             bash (or sh)")
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    if command == "finetune":
        return finetune(rest)
    if command == "verify":
        return exec_command([sys.executable, "-m", "verify", *rest])
    if command == "info":
        return info(rest)
    if command == "shell":
        shell = shutil.which("bash") or shutil.which("sh") or "/bin/sh"
        return exec_command([shell, *rest])
    return exec_command(argv)


def exec_command(argv: list[str]) -> int:
    """Replace this process (signals and exit code belong to the command, as in a plain image)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        _err(f"command not found: {argv[0]}",
             f"use one of {', '.join(SUBCOMMANDS)}, or a program installed in the image")
        return 127
    except PermissionError:
        _err(f"permission denied: {argv[0]}", "check the file is executable")
        return 126
    return 0  # unreachable: execvp does not return


def info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m entrypoint info", description="summarize the build lock")
    parser.add_argument("--json", action="store_true", help="print the raw lock JSON")
    args = parser.parse_args(argv)
    from contracts.lock import LockError, load_lock, lock_path
    from entrypoint.info import summarize

    try:
        lock = load_lock()
    except LockError as exc:
        _err(str(exc), exc.fix)
        return 1
    print(lock.to_json() if args.json else summarize(lock, str(lock_path())), end="" if args.json else "\n")
    return 0


def finetune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m entrypoint finetune",
        description="verify-gated FSDP2 SFT. Config layers: image defaults (lock) < --config YAML < flags < KEY=VALUE.",
    )
    p.add_argument("--config", help="finetune YAML (sections: model, data, packing, train, parallel, checkpoint, "
                                    "output, launch)")
    p.add_argument("--allow-fallback", action="store_true",
                   help="train even when verify fails (also FTIMAGE_ALLOW_FALLBACK=1); forces 2D padded batches; "
                        "recorded in run_report.json")
    p.add_argument("--packing", choices=("packed", "padded"), help="= packing.mode")
    p.add_argument("--profile-steps", metavar="A:B", help="= output.profile_steps")
    p.add_argument("--output-dir", help="= output.dir")
    p.add_argument("--dry-run", action="store_true", help="resolve config, gate and topology; print the plan; "
                                                          "do not launch")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.max_steps=100 packing.budget=4096")
    return p


def finetune(argv: list[str]) -> int:
    from contracts.finetune_config import ConfigError
    from entrypoint.finetune import FinetuneError, prepare

    args = finetune_parser().parse_args(argv)
    allow_fallback = args.allow_fallback or os.environ.get("FTIMAGE_ALLOW_FALLBACK", "") in ("1", "true", "yes")
    flags = []
    if args.packing:
        flags.append(f"packing.mode={args.packing}")
    if args.profile_steps:
        flags.append(f"output.profile_steps={args.profile_steps}")
    if args.output_dir:
        flags.append(f"output.dir={args.output_dir}")
    try:
        launch = prepare(config_file=args.config, overrides=flags + list(args.overrides),
                         allow_fallback=allow_fallback, env=dict(os.environ), log=_log)
    except (ConfigError, FinetuneError) as exc:
        _err(str(exc), getattr(exc, "fix", ""))
        return getattr(exc, "exit_code", EXIT_USAGE)
    if args.dry_run:
        print(json.dumps({"argv": launch.argv, "plan": str(launch.plan_path)}, indent=2))
        return 0
    _log(f"[finetune] launching: {' '.join(launch.argv)}")
    return run_torchrun(launch.argv, launch.env, launch.plan["config"]["output"]["dir"])


def run_torchrun(argv: list[str], env: dict, output_dir: str) -> int:
    """torchrun (`python -m torch.distributed.run`), called in this process. Calling it as
    a library instead of exec'ing it keeps its behaviour (same agent, same signals) but
    lets a worker failure end in one clear line rather than the agent's own traceback:
    the failing worker has already printed its ERROR with a fix."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    assert argv[1:3] == ["-m", "torch.distributed.run"], argv
    os.environ.clear()
    os.environ.update(env)  # workers inherit the agent's environment
    try:
        run(parse_args(argv[3:]))
    except ChildFailedError as exc:
        ranks = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(exc.failures.items()))
        _err(f"training failed on {ranks}; the worker's ERROR line above says why",
             f"see {output_dir}/run_report.json; fix the cause and rerun with the same output.dir to resume")
        return 1
    return 0
