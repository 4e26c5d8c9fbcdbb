"""The GPU proof kit's phase per model family (`family:<name>`, bench/gpu_proof.py): verify's
model_fit, dispatch and isolation rows for that family on the GPU against the kit's lock, then the
family's row of bench/family_bench.py, into DIR/family-<name>.json; and the summary's lines.

    python3 bench/kit_family.py NAME --lock DIR/build.lock.json --json-out DIR/family-NAME.json [--rehearse]

verify alone proves the families its lock names (images/qwen27b's: qwen3_5_text). Here verify's
own checks run for any family against that same lock, so a family whose kernels or head dims the
kit did not compile fails with verify's reason: that is the finding, not a kit error. When
model_fit says the compiled flash-attn cannot run the family's head dims, the bench runs both
modes on sdpa (the fused/fallback comparison is then the family's other kernels) and says so.

The order of the family phases (family_priority) comes from the data: the kit image's own
families, then by how many of what a family needs the image's kernels do not back (the
manifest's `replaces:`; attention counts as backed only at head dims the image compiled), then
by name. Every family in families/ gets a phase; none is listed by hand.
--rehearse: CPU, the tiny flavour, the kernels' CPU doubles in the bench (bench/family_bench.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CHECKS = ("model_fit", "dispatch", "isolation")
VERDICT_CHECKS = ("dispatch", "isolation")     # the verdict's rows; model_fit explains them
# the kit's bench row per family: fewer documents and steps than a standalone run, to fit the phase limit
KIT_BENCH = ["--docs", "24", "--min-steps", "4", "--profile-steps", "1"]


def family_priority(image: str) -> list[str]:
    """Every family in families/, in the order the kit proves them (see the module docstring)."""
    from contracts import safe_yaml
    from families import known_families, load_family

    spec = safe_yaml.load_file(REPO / image / "image.yaml")
    own = list(spec.get("model_families") or [spec.get("model_family")])
    manifest = safe_yaml.load_file(REPO / "kernels_manifest.yaml")["kernels"]
    backed = {f for k in spec.get("kernels", []) for f in manifest.get(k, {}).get("replaces", [])}
    head_dims = {d for name in own if name in known_families() for d in load_family(name).attention.head_dims}

    def unbacked(name: str) -> int:
        family = load_family(name)
        missing = [f for f in family.needs() if f not in backed]
        attention_fits = set(family.attention.head_dims) <= head_dims
        return len(missing) + (0 if attention_fits or family.attention.replaces in missing else 1)

    return sorted(known_families(), key=lambda n: (n not in own, unbacked(n), n))


def verify_rows(name: str, lock_path: Path, device: str) -> list[dict]:
    """verify's rows for one family against the lock, through verify's own runner (one Context,
    as `python -m verify` builds for each family its lock names)."""
    from contracts.lock import LockError, load_lock
    from families import load_family
    from verify.context import Context
    from verify.report import CheckResult, Status
    from verify.runner import _run_one
    from verify.scratch import NoScratch, ensure_scratch

    try:
        ensure_scratch()
    except NoScratch as exc:
        return [CheckResult("environment.scratch", Status.FAIL, str(exc), exc.fix).to_dict()]
    rows, lock = [], None
    try:
        lock = load_lock(lock_path)
        rows.append(CheckResult("lock", Status.PASS, f"{lock_path}: image={lock.image} families="
                                f"{','.join(lock.families)}"))
    except LockError as exc:
        rows.append(CheckResult("lock", Status.FAIL, str(exc), exc.fix))
    ctx = Context(lock=lock, device=device, family=load_family(name))
    for check in CHECKS:
        rows += _run_one(check, ctx)
    return [r.to_dict() for r in rows]


def verdict(result: dict) -> tuple[str, str]:
    """(PASS or FAIL, why): dispatch and isolation all pass and the bench measured both modes with
    every fused function bound to a kernel in the fused run."""
    rows = [r for r in result.get("rows", []) if r["check"].split(".")[0] in ("lock", *VERDICT_CHECKS)]
    bad = [r for r in rows if r["status"] in ("FAIL", "WARN")]
    if not any(r["check"].split(".")[0] in VERDICT_CHECKS for r in rows):
        return "FAIL", "verify's rows did not run"
    if bad:
        return "FAIL", f"{bad[0]['check']}: {bad[0]['detail'][:140]}"
    bench = result.get("bench") or {}
    for mode in ("fused", "fallback"):
        if "runs" not in bench.get(mode, {}):
            return "FAIL", f"bench {mode}: {bench.get(mode, {}).get('error', 'did not run')[:140]}"
    unbound = [f for f, b in bench["fused"].get("bindings", {}).items() if not b["kernel"]]
    if unbound:
        return "FAIL", f"bench: the fused run fell back for {', '.join(unbound)}"
    return "PASS", ""


def summary_lines(results: Path, names: list[str]) -> list[str]:
    """The summary's per-family lines: each family's verdict and its bench ratios, or why not."""
    lines = ["", f"{'family':<18}{'verdict':<9}{'ops fb/fused':>13}{'step fb/fused':>15}{'pass packed/padded':>20}"
             "  why"]
    for name in names:
        try:
            result = json.loads((results / f"family-{name}.json").read_text())
        except (OSError, ValueError):
            lines.append(f"{name:<18}{'NOT RUN':<9}")
            continue
        ratios = (result.get("bench") or {}).get("ratios", {})
        shown = [ratios.get("ops_fallback_over_fused (padded)"), ratios.get("step_time_fallback_over_fused (padded)"),
                 ratios.get("pass_time_packed_over_padded (fused)")]
        cells = [f"{v:.2f}x" if isinstance(v, float) else "-" for v in shown]
        if result.get("device") == "cpu":     # the doubles on a CPU: op counts hold, times mean nothing
            cells[1:] = ["(cpu)", "(cpu)"]
        note = result.get("why") or ""
        if result.get("attention_note"):
            note = f"{note}; {result['attention_note']}" if note else result["attention_note"]
        lines.append(f"{name:<18}{result.get('verdict', '?'):<9}{cells[0]:>13}{cells[1]:>15}{cells[2]:>20}  {note}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family")
    p.add_argument("--lock", type=Path, required=True, help="the kit's lock (DIR/build.lock.json)")
    p.add_argument("--json-out", type=Path, required=True)
    p.add_argument("--rehearse", action="store_true", help="CPU, tiny flavour, the kernels' CPU doubles")
    args = p.parse_args(argv)
    device = "cpu" if args.rehearse else "cuda"
    result: dict = {"family": args.family, "device": device, "rehearsal": args.rehearse}

    def write() -> None:
        result["verdict"], result["why"] = verdict(result)
        args.json_out.write_text(json.dumps(result, indent=2, default=str))

    result["rows"] = verify_rows(args.family, args.lock, device)
    write()                     # a bench that runs out of time keeps the rows
    misfit = [r for r in result["rows"] if r["check"].startswith("model_fit") and r["status"] == "FAIL"]
    attention = "sdpa" if misfit else "family"
    if misfit:
        result["attention_note"] = f"bench on sdpa: {misfit[0]['check']} FAIL"
    from bench import family_bench

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        family_bench.main(["--families", args.family, "--attention", attention, "--json-out", str(out), *KIT_BENCH,
                           *(["--device", "cpu", "--flavour", "tiny"] if args.rehearse else [])])
        if out.is_file():
            bench = json.loads(out.read_text())
            result["bench"] = {**bench["families"][args.family],
                               **{k: bench[k] for k in ("device", "flavour", "budget", "docs", "note") if k in bench}}
    write()
    print(f"family {args.family}: {result['verdict']} {result['why']}")
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
