"""`python -m entrypoint` (the image ENTRYPOINT): finetune | inspect-data | verify | gate |
info | shell, and any other argv exec'd as a plain command so the image doubles as a
cluster base image (`docker run IMAGE id -u`, `docker run IMAGE torchrun ...`).

With FTIMAGE_REQUIRE_VERIFY=1 in the environment, any other command (and `shell`) runs through
the gate too: verify first, and the command only if it passes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from entrypoint.observability.console import ALLOW_FALLBACK_ENV, err, log, truthy

SUBCOMMANDS = ("finetune", "inspect-data", "verify", "gate", "info", "shell")
EXIT_USAGE = 2
EXIT_GATE = 3          # verify did not pass and no override was given
REQUIRE_VERIFY_ENV = "FTIMAGE_REQUIRE_VERIFY"
USAGE = """usage: python -m entrypoint {finetune,inspect-data,verify,gate,info,shell} ... | COMMAND [ARGS]
  finetune --config CONFIG.yaml [--allow-fallback] [--print-config] [--json-logs] [KEY=VALUE ...]
  finetune export --checkpoint step-N --config CONFIG.yaml   a kept checkpoint as HF safetensors
  inspect-data --config CONFIG.yaml [--rows N] [--json]   what the trainer will train on, trained tokens marked
  verify [verify args]     run the preflight checks (python -m verify)
  gate [--allow-fallback] [--model DIR] [--param-dtype D] -- COMMAND [ARGS]
                           run verify, then exec COMMAND only if it passed (exit 3 otherwise)
  info [--json]            summarize the build lock
  shell [ARGS]             bash (or sh)"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    # each subcommand's modules are imported when it runs: every command (`docker run IMAGE id -u`) starts here
    if command == "finetune":
        from entrypoint.finetune_cli import finetune
        return finetune(rest)
    if command == "inspect-data":
        from entrypoint.finetune_cli import inspect_data
        return inspect_data(rest)
    if command == "verify":
        return exec_command([sys.executable, *python_flags(), "-m", "verify", *rest])
    if command == "gate":
        return gate(rest)
    if command == "info":
        return info(rest)
    if command == "shell":
        argv = [shutil.which("bash") or shutil.which("sh") or "/bin/sh", *rest]
    if truthy(os.environ.get(REQUIRE_VERIFY_ENV)):
        return gate(["--", *argv])   # every pass-through command, `shell -c CMD` included
    return exec_command(argv)


def python_flags() -> list[str]:
    """Keep isolated mode for Python children when we run in it (the image's ENTRYPOINT uses
    -I, so a file in the working directory cannot shadow a module)."""
    return ["-I"] if sys.flags.isolated else []


def exec_command(argv: list[str]) -> int:
    """Replace this process (signals and exit code belong to the command, as in a plain image)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        err(f"command not found: {argv[0]}",
            f"use one of {', '.join(SUBCOMMANDS)}, or a program installed in the image")
        return 127
    except PermissionError:
        err(f"permission denied: {argv[0]}", "check the file is executable")
        return 126
    return 0  # unreachable: execvp does not return


def gate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m entrypoint gate",
                                description="run verify, then exec COMMAND only if every check passed")
    p.add_argument("--allow-fallback", action="store_true",
                   help=f"run COMMAND even when verify fails (also {ALLOW_FALLBACK_ENV}=1); logged")
    p.add_argument("--model", help="model directory (config.json) the command will train, for the model-fit check")
    p.add_argument("--param-dtype", default="bfloat16", help="dtype the command trains in (default bfloat16)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def gate(argv: list[str], *, run_verify=None) -> int:
    """Verify, then exec. The contract is the same as finetune's: nothing runs on kernels
    that were not proven, unless the user says so on the record (stderr and the exit path)."""
    args = gate_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        err("gate needs a command to run", "e.g. python -m entrypoint gate -- torchrun --nproc-per-node 8 train.py")
        return EXIT_USAGE
    if run_verify is None:
        from entrypoint.launcher.verify_gate import run_verify  # as in main()
    from entrypoint.launcher.job_env import job_env  # as in main()
    from verify.scratch import NoScratch

    try:   # the command gets what our own ranks get: writable caches, HOME, a user name for its uid
        os.environ.update(job_env(os.environ))
    except NoScratch as exc:
        err(str(exc), exc.fix)
        return EXIT_USAGE
    allow = args.allow_fallback or truthy(os.environ.get(ALLOW_FALLBACK_ENV))
    log(f"[gate] running verify before: {' '.join(command)}")
    outcome = run_verify(model=args.model, param_dtype=args.param_dtype)
    if not outcome.passed:
        log(outcome.table)
        if not allow:
            err(f"verify did not pass (worst: {outcome.worst}); not starting {command[0]}",
                f"fix the failing checks above, or set {ALLOW_FALLBACK_ENV}=1 (or gate --allow-fallback) to run "
                "anyway on the fallback kernels; packed batches are then unsafe (documents leak into each other)")
            return EXIT_GATE
        log(f"[gate] WARNING: verify did not pass (worst: {outcome.worst}); override given "
            f"({'--allow-fallback' if args.allow_fallback else ALLOW_FALLBACK_ENV + '=1'}), running {command[0]} "
            "ON THE RECORD on fallback kernels")
        os.environ["FTIMAGE_VERIFY_OVERRIDDEN"] = outcome.worst
        os.environ[ALLOW_FALLBACK_ENV] = "1"   # the runtime guard in COMMAND's processes honours the same override
    else:
        log(f"[gate] verify passed for model famil{'ies' if len(outcome.families()) > 1 else 'y'} "
            f"{', '.join(outcome.families()) or '(none named)'}")
    os.environ.pop(REQUIRE_VERIFY_ENV, None)  # the command itself is not gated twice
    return exec_command(command)


def info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m entrypoint info", description="summarize the build lock")
    parser.add_argument("--json", action="store_true", help="print the raw lock JSON")
    args = parser.parse_args(argv)
    from contracts.lock import LockError, load_lock, lock_path  # as in main()
    from entrypoint.info import summarize

    try:
        lock = load_lock()
    except LockError as exc:
        err(str(exc), exc.fix)
        return 1
    print(lock.to_json() if args.json else summarize(lock, str(lock_path())), end="" if args.json else "\n")
    return 0
