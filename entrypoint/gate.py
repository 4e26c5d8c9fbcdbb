"""The verify gate: one small function between training (ours, or any command through the
gate) and verify/. Training runs only when verify passes (fail closed); whatever verify's
internals become, the rest of the entrypoint sees one plain result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class GateOutcome:
    passed: bool                       # True only when verify's worst status exits 0
    worst: str                         # PASS / SKIP / WARN / FAIL / ERROR (verify could not run)
    table: str                         # the human table verify printed
    report: dict[str, Any] = field(default_factory=dict)  # verify's JSON report, for run_report.json

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "worst": self.worst, "report": self.report}


def run_verify(*, model: str | None = None, param_dtype: str = "bfloat16") -> GateOutcome:
    """Run verify's full check set on this node, for the model to be trained (its config.json)
    and the dtype it trains in. Any failure to even run verify is a FAIL."""
    try:
        from verify import run_checks

        report = run_checks(model=model, param_dtype=param_dtype)
    except Exception as exc:  # noqa: BLE001 - an import or crash must fail closed, readably
        msg = f"verify could not run: {type(exc).__name__}: {exc}"
        return GateOutcome(passed=False, worst="ERROR", table=msg,
                           report={"error": msg, "results": [], "worst": "ERROR", "passed": False})
    return GateOutcome(passed=bool(report.passed), worst=report.worst.name, table=report.to_table(),
                       report=report.to_dict())
