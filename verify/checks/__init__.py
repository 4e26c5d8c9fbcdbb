"""One module per check; each exposes run(ctx) -> list[CheckResult] and pure decide_* helpers."""
