"""verify: the preflight that proves the fused, packing-correct path inside the image.

    from verify import run_checks
    report = run_checks()            # or run_checks("dispatch,isolation", device="cpu")
    report.worst, report.passed, report.exit_code, report.to_json()
"""
from verify.report import CheckResult, Report, Status


def run_checks(*args, **kwargs) -> Report:
    # Imported lazily: `import verify` must stay cheap (no torch/transformers) for the entrypoint.
    from verify.runner import run_checks as _run

    return _run(*args, **kwargs)


__all__ = ["run_checks", "Report", "CheckResult", "Status"]
