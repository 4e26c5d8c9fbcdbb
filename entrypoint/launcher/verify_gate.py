"""The verify gate: one small function between training (ours, or any command through the
gate) and verify/. Training runs only when verify passes (fail closed); whatever verify's
internals become, the rest of the entrypoint sees one plain result.

verify runs in a child process. Its probes initialise CUDA and allocate on the GPU; in the
launcher, which lives as long as the run (torchrun's agent runs in it), that context and its
memory would stay held on GPU 0 beside the training workers.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from verify.report import Report


@dataclass(frozen=True, kw_only=True)
class GateOutcome:
    passed: bool                       # True only when verify's worst status exits 0
    worst: str                         # PASS / SKIP / WARN / FAIL / ERROR (verify could not run)
    table: str                         # the human table verify printed
    report: dict[str, Any] = field(default_factory=dict)  # verify's JSON report, for run_report.json

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "worst": self.worst, "report": self.report}

    def families(self) -> tuple[str, ...]:
        """The model families this verify proved (or tried to): the mounted model's, named by its
        model_type, else every family the image's lock lists."""
        for row in self.report.get("results", ()):
            if row.get("check") == "model_family" and (row.get("data") or {}).get("family"):
                return (row["data"]["family"],)
        from contracts.lock import LockError, load_lock, lock_path  # the lock only when asked

        try:
            return load_lock(lock_path()).families
        except (LockError, OSError):
            return ()


def verify_argv(*, model: str | None, param_dtype: str) -> list[str]:
    isolated = ["-I"] if sys.flags.isolated else []   # the image's own code only, as in this process
    return [sys.executable, *isolated, "-m", "verify", "--json", "--param-dtype", param_dtype,
            *(["--model", str(model)] if model else [])]


def run_verify(*, model: str | None = None, param_dtype: str = "bfloat16") -> GateOutcome:
    """Run verify's full check set on this node, for the model to be trained (its config.json)
    and the dtype it trains in, in a child process. Any failure to even run verify is a FAIL."""
    try:
        proc = subprocess.run(verify_argv(model=model, param_dtype=param_dtype), stdout=subprocess.PIPE,
                              stderr=None, text=True, check=False)
    except OSError as exc:
        proc, problem = None, f"{type(exc).__name__}: {exc}"
    try:
        report = Report.from_dict(json.loads(proc.stdout)) if proc else None
    except (ValueError, KeyError, TypeError) as exc:
        report, problem = None, f"it exited {proc.returncode} without a readable report ({type(exc).__name__}); " \
                                "its own error is printed above"
    if report is None:
        msg = f"verify could not run: {problem}"
        return GateOutcome(passed=False, worst="ERROR", table=msg,
                           report={"error": msg, "results": [], "worst": "ERROR", "passed": False})
    return GateOutcome(passed=bool(report.passed), worst=report.worst.name, table=report.to_table(),
                       report=report.to_dict())
