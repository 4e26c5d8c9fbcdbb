"""The verify gate: one small function between finetune and verify/.

finetune trains only when verify passes (fail closed). The call is isolated here so the
rest of the entrypoint sees one plain result, whatever verify's internals become.
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

    def failing_rows(self) -> list[dict]:
        return [r for r in self.report.get("results", []) if r.get("status") in ("WARN", "FAIL")]

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "worst": self.worst, "report": self.report}


def run_verify() -> GateOutcome:
    """Run verify's full check set on this node. Any failure to even run verify is a FAIL."""
    try:
        from verify import run_checks

        report = run_checks()
    except Exception as exc:  # noqa: BLE001 - an import or crash must fail closed, readably
        msg = f"verify could not run: {type(exc).__name__}: {exc}"
        return GateOutcome(passed=False, worst="ERROR", table=msg,
                           report={"error": msg, "results": [], "worst": "ERROR", "passed": False})
    return GateOutcome(passed=bool(report.passed), worst=report.worst.name, table=report.to_table(),
                       report=report.to_dict())
