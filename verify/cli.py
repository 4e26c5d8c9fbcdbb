"""`python -m verify` / `docker run IMAGE verify`: print the table (or JSON), exit with the worst status."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from verify.report import CheckResult, Report, Status
from verify.runner import ALL_CHECKS, AUDIT_CHECKS, CHECKS, DEVICES, UsageError, run_checks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verify",
        description="Prove the fused kernels run (forward and backward) and packed documents stay isolated. "
                    "Exit code: 0 pass, 1 warn, 2 fail.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--lock", metavar="PATH", help="build lock to check against (default: $FTIMAGE_LOCK or "
                   "/etc/ftimage/build.lock.json)")
    p.add_argument("--no-lock", action="store_true", help="read no lock (the audit of an image this project did not "
                   "build: `python -m build audit IMAGE`): rows that compare with a lock are SKIP with that reason, "
                   f"and the {','.join(AUDIT_CHECKS)} rows run too")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where to run the probes; auto = cuda if present, else cpu")
    p.add_argument("--checks", default=None, help=f"comma-separated subset of {','.join(ALL_CHECKS)} (default: "
                   f"{','.join(CHECKS)}; with --no-lock all of them)")
    p.add_argument("--json-file", metavar="PATH", help="also write the JSON report to PATH (the table still prints)")
    p.add_argument("--deep", action="store_true", help="hash every installed file against RECORD, even huge ones")
    p.add_argument("--model", metavar="DIR", help="the model to be trained (its config.json): refused if it needs "
                   "head dims, dtypes or features the image's kernels were not compiled for")
    p.add_argument("--families", metavar="A,B|all", help="the model families to prove when no --model is given "
                   "(default: the lock's; with --no-lock, qwen3_5_text); `all`: every family this verify knows")
    p.add_argument("--param-dtype", default="bfloat16", help="the dtype training runs in (bfloat16, float16, "
                   "float32); refused if the image's kernels lack it")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # transformers' fallback warning says the package "is not installed" even when its import
    # failed for another reason; our dispatch rows give the real cause, so keep stderr quiet.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        report = run_checks(args.checks, device=args.device, lock=args.lock, deep=args.deep, model=args.model,
                            param_dtype=args.param_dtype, no_lock=args.no_lock, families=args.families)
    except UsageError as exc:
        report = Report.of([CheckResult("usage", Status.FAIL, str(exc), exc.fix)])
    if args.json_file:
        try:
            with open(args.json_file, "w") as fh:
                fh.write(report.to_json())
        except OSError as exc:
            report = Report.of([*report.results, CheckResult("output", Status.FAIL, f"cannot write {exc.filename}: "
                                                              f"{exc.strerror}", "give --json-file a writable path")])
    if args.json:
        sys.stdout.write(report.to_json())
    else:
        width = shutil.get_terminal_size((200, 40)).columns
        sys.stdout.write(report.to_table(width=max(width, 120)))
    sys.stdout.flush()
    return report.exit_code
