"""The finetune and inspect-data commands: argument parsing and error reporting over
entrypoint.launcher.preflight (the library), and torchrun called in-process."""
from __future__ import annotations

import argparse
import json
import os
import sys

from contracts.errors import headline
from contracts.events import EventLog
from contracts.finetune_config import ConfigError
from entrypoint.data.sources import DataError
from entrypoint.inputs import InputError, check_remote_code
from entrypoint.launcher.export_job import prepare_export
from entrypoint.launcher.job_env import job_env
from entrypoint.launcher.preflight import FinetuneError, lock_layer, prepare, print_config, resolve_config
from entrypoint.launcher.supervise import Stops, run_agent, stop_behind
from entrypoint.observability.console import ALLOW_FALLBACK_ENV, JSON_LOGS_ENV, err, log, truthy
from verify.scratch import NoScratch, ensure_tempdir

EXIT_USAGE = 2


def finetune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m entrypoint finetune",
        description="verify-gated FSDP2 SFT. Config layers: image defaults (lock) < --config YAML < flags < KEY=VALUE.",
    )
    p.add_argument("--config", help="finetune YAML (sections: model, data, packing, train, parallel, checkpoint, "
                                    "output, launch)")
    p.add_argument("--allow-fallback", action="store_true",
                   help=f"train even when verify fails (also {ALLOW_FALLBACK_ENV}=1); forces 2D padded batches; "
                        "recorded in run_report.json")
    p.add_argument("--packing", choices=("packed", "padded"), help="= packing.mode")
    p.add_argument("--profile-steps", metavar="A:B", help="= output.profile_steps")
    p.add_argument("--output-dir", help="= output.dir")
    p.add_argument("--print-config", action="store_true",
                   help="print the merged config, each key with the layer that set it, and exit")
    p.add_argument("--json-logs", action="store_true",
                   help="progress as JSON lines on stderr (one schema for tokenisation and training)")
    p.add_argument("--dry-run", action="store_true", help="resolve config, gate and topology; print the plan; "
                                                          "do not launch")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.max_steps=100 packing.budget=4096")
    return p


def flag_overrides(args: argparse.Namespace) -> list[str]:
    flags = []
    if args.packing:
        flags.append(f"packing.mode={args.packing}")
    if args.profile_steps:
        flags.append(f"output.profile_steps={args.profile_steps}")
    if args.output_dir:
        flags.append(f"output.dir={args.output_dir}")
    return flags


def export(argv: list[str]) -> int:
    """`finetune export --checkpoint step-N`: a kept checkpoint as HF safetensors, on its own."""
    p = argparse.ArgumentParser(prog="python -m entrypoint finetune export",
                                description="export a kept checkpoint as HF safetensors to <output.dir>/exports/step-N")
    p.add_argument("--checkpoint", required=True, help="step-N under <output.dir>/checkpoints, or a step folder")
    p.add_argument("--config", help="the run's finetune YAML (model, output.dir, parallel, export dtype)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_intermixed_args(argv)
    try:
        ensure_tempdir()   # before torch is imported (verify/scratch.py)
        launch = prepare_export(config_file=args.config, overrides=list(args.overrides), checkpoint=args.checkpoint,
                                env=dict(os.environ), log=log)
    except (ConfigError, FinetuneError, NoScratch) as exc:
        err(str(exc), getattr(exc, "fix", ""))
        return EXIT_USAGE
    return run_agent(launch.argv, launch.env, launch.plan.config.output.dir, events=None, log=log)


def finetune(argv: list[str]) -> int:
    if argv[:1] == ["export"]:
        return export(argv[1:])
    with Stops() as stops:   # SIGINT/SIGTERM from here on: ends preflight, or reaches the workers (supervise.py)
        try:
            return _finetune(argv, stops)
        except BaseException as exc:
            if (stop := stop_behind(exc)) is None:
                raise
            return stopped_before_launch(stop, log)


def stopped_before_launch(exc, say) -> int:
    say(f"[finetune] stopped by {exc} before any worker started: nothing was trained, nothing needs saving; "
        "rerun the same command to start (or resume)")
    return 128 + exc.signum


def _finetune(argv: list[str], stops) -> int:
    args = finetune_parser().parse_intermixed_args(argv)   # KEY=VALUE before or after the flags
    flags = flag_overrides(args)
    events = EventLog(json_lines=args.json_logs)
    say, fail = (log, err) if not args.json_logs else (
        lambda msg: events.emit("finetune", msg),
        lambda msg, fix="": events.emit("finetune", msg, level="error", fix=fix))
    try:
        if args.print_config:
            print(print_config(args.config, list(args.overrides), flags))
            return 0
        ensure_tempdir()   # before torch is imported (verify/scratch.py); TMPDIR, if set, reaches the workers
        allow_fallback = args.allow_fallback or truthy(os.environ.get(ALLOW_FALLBACK_ENV))
        env = dict(os.environ)
        if args.json_logs:
            env[JSON_LOGS_ENV] = "1"   # the workers inherit it
        launch = prepare(config_file=args.config, overrides=list(args.overrides), flags=flags,
                         allow_fallback=allow_fallback, env=env, log=say, events=events)
    except (ConfigError, FinetuneError, NoScratch) as exc:
        fail(str(exc), getattr(exc, "fix", ""))
        return getattr(exc, "exit_code", EXIT_USAGE)
    except BaseException as exc:   # a stop, or an error a library's cleanup raised in front of one
        if (stop := stop_behind(exc)) is None:
            raise
        return stopped_before_launch(stop, say)
    if launch is None:   # nothing to do (a finished run): prepare said so
        return 0
    if args.dry_run:
        print(json.dumps({"argv": launch.argv, "plan": str(launch.plan_path)}, indent=2))
        return 0
    stops.hand_over()   # from `launching:` on, a stop is kept for the workers, however early it comes
    say(f"[finetune] launching: {' '.join(launch.argv)}")
    return run_agent(launch.argv, launch.env, launch.plan.config.output.dir,
                     events=events if args.json_logs else None, log=say, stops=stops)


def inspect_data(argv: list[str]) -> int:
    # the job's environment (job_env.py), as finetune builds its corpus in: importing torch asks
    # tempfile for a folder, and importing torch._dynamo makes inductor's cache folder
    try:
        os.environ.update(job_env(os.environ))
    except NoScratch as exc:
        err(str(exc), exc.fix)
        return EXIT_USAGE
    # numpy, torch and the tokenizer for inspect-data only: `finetune` checks its config without them
    from entrypoint.data.corpus_build import resolve_all
    from entrypoint.data.inspect_data import inspect
    from entrypoint.model import ModelError, load_tokenizer

    p = argparse.ArgumentParser(prog="python -m entrypoint inspect-data",
                                description="render documents exactly as the trainer sees them, trained tokens marked")
    p.add_argument("--config", required=True, help="the finetune YAML (its model and data sections are used)")
    p.add_argument("--rows", type=int, default=3, help="documents to show (default 3); the summary counts all rows")
    p.add_argument("--json", action="store_true", help="one JSON object: documents (trained spans) and summary")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_intermixed_args(argv)
    if args.rows < 0:
        err(f"--rows must be >= 0, got {args.rows}", "pass --rows N with N >= 0")
        return EXIT_USAGE
    try:
        defaults, _ = lock_layer(lambda _m: None)
        cfg = resolve_config(args.config, list(args.overrides), defaults)
        resolve_all(cfg.data)
        check_remote_code([cfg.model.path, cfg.model.tokenizer], cfg.model.trust_remote_code)
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
        inspect(cfg, tokenizer, rows=args.rows, as_json=args.json, colour=sys.stdout.isatty() and not args.json)
    except (ConfigError, DataError, ModelError, InputError) as exc:
        err(headline(exc), getattr(exc, "fix", ""))
        return EXIT_USAGE
    return 0
