"""GPU proof kit: on a bare GPU host (no Docker, no network), compile the pinned kernels with the
project's own recipe, prove the fused forward and backward paths and packed isolation with
verify, train with the image's own `finetune`, and benchmark fused vs fallback, in one command.

    python3 bench/gpu_proof.py [--results DIR]          # on the GPU host, from the repo root
    python3 bench/gpu_proof.py --rehearse [--python PY]  # here: every step that needs no GPU
    python3 bench/gpu_proof.py --prepare                 # fetch what must travel into .kit/
    python3 bench/gpu_proof.py --families a,b            # of the family phases, only these

Phases, in priority order (what matters most runs first), each recorded in DIR/phases.json as it
ends; a second run skips what passed and finishes the rest:
  stage     the carried pure-Python wheels and the trimmed Triton 3.7.1 (bench/kit_triton.py) into
            the kit's site folder, first on PYTHONPATH; then every module the phases import must
            import (a gap is one named error with the fix)
  compile   `python -m build kernels build-here images/qwen27b --arch sm_90` (or, with compiled
            wheels carried in .kit/built from an earlier run's DIR/built, no compile at all)
  refusal   the specialised flash-attn and causal-conv1d refuse what they were not compiled for
  verify    every verify row against the kit's lock, with no override
  finetune  bench/kit_finetune.py: the image's own finetune (SIGTERM, resume, export, generate,
            fused vs fallback losses)
  bench     bench/gpu_bench.py: fused vs fallback (and transformers <= 5.16's reference), packed vs
            padded, the 27B per-layer widths at 4 and 8 layers
  family:<name>  one per family in families/ (bench/kit_family.py, in its family_priority order):
            verify's model_fit, dispatch and isolation rows for that family against the kit's
            lock, then its row of bench/family_bench.py (fused vs fallback, packed vs padded, at
            the family's `bench` widths); DIR/family-<name>.json
  summary   DIR/summary.txt, written even when a phase fails or time runs out; it names each
            family's verdict
Each phase runs in its own process group under a limit (its own, and what is left of --deadline,
8 min 50 s by default); at the limit the group and its workers are killed.

The kit runs the project's code with PYTHONPATH (not the image's isolated `-I`, which drops
PYTHONPATH): the compiled wheels and the trimmed Triton must come first on the path.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.kit_runner import ResultsNotWritable, Runner  # noqa: E402

KIT = REPO / ".kit"
IMAGE = "images/qwen27b"
ARCH = "sm_90"
CARRY_LIMIT = 64 << 20
# Pure-Python wheels the GPU host lacks, installed --no-deps into the kit's site folder: pyelftools
# (build-here reads the compiled archs), and `datasets` with the two it needs that the host has not
# (finetune reads its data through it), at the image's pins (images/qwen27b/image.yaml).
CARRIED_WHEELS = ("pyelftools==0.32", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19")
HOST_PYTHON = "3.12"   # the GPU host's interpreter: wheels with a per-version tag are fetched for it
# What the phases import, checked once the wheels are staged: a gap is one named error in seconds,
# not a traceback from a phase minutes later
RUNTIME_MODULES = ("torch", "transformers", "tokenizers", "safetensors", "yaml", "jinja2", "numpy", "packaging",
                   "datasets", "elftools")
LIMITS = {"stage": 60, "compile": 330, "refusal": 60, "verify": 200, "finetune": 300, "bench": 330, "family": 240}
PHASES = ("compile", "refusal", "verify", "finetune", "bench")   # then one family:<name> per family
DEADLINE = 530


class Kit:
    def __init__(self, runner: Runner, python: str, rehearse: bool):
        self.runner = runner
        self.results = runner.results
        self.python = python
        self.rehearse = rehearse
        self.work = Path(os.environ.get("FTIMAGE_PROOF_WORK", "/tmp/ftimage-proof"))
        self.site = self.work / "site"
        self.triton_site = self.work / "triton"
        self.extra_env: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        paths = [str(self.triton_site), str(self.site), str(REPO), os.environ.get("PYTHONPATH", "")]
        return {**os.environ, **self.extra_env, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TRANSFORMERS_VERBOSITY": "error", "FTIMAGE_CACHE": str(KIT / "cache"),
                # Triton's compiled kernels and fla's autotuning results persist in the results, so a
                # carried-back results folder skips both on the next run
                "TRITON_CACHE_DIR": str(self.results / "triton-cache"),
                "FTIMAGE_LOCK": str(self.results / "build.lock.json")}

    def run(self, phase: str, argv: list[str], **kw) -> int:
        return self.runner.run(phase, argv, timeout=LIMITS[phase.partition(":")[0]], env=self.env(), cwd=REPO,
                               **kw)


def family_phases() -> list[str]:
    """One phase per family in families/, in the order the kit proves them."""
    from bench.kit_family import family_priority

    return [f"family:{name}" for name in family_priority(IMAGE)]


def machine(kit: Kit) -> dict:
    info = {"platform": platform.platform(), "cores": os.cpu_count(), "commit": _commit()}
    try:
        query = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total", "--format=csv,noheader"]
        info["gpu"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = "none (no nvidia-smi)"
    probe = ("import json, sys, importlib.metadata as md\n"
             "v = {}\n"
             "for n in ('torch', 'transformers', 'triton', 'fla-core', 'datasets'):\n"
             "    try: v[n] = md.version(n)\n"
             "    except md.PackageNotFoundError: v[n] = None\n"
             "try:\n    import triton; v['triton.__version__'] = triton.__version__\n"
             "except Exception as e: v['triton.__version__'] = repr(e)\n"
             "v['python'] = sys.version.split()[0]\n"
             "print(json.dumps(v))")
    out = subprocess.run([kit.python, "-c", probe], capture_output=True, text=True, env=kit.env())
    info["python"] = json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}
    kit.runner.say(f"machine: {json.dumps(info)}")
    (kit.results / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _commit() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def stage(kit: Kit) -> bool:
    from bench.kit_triton import KitTritonError
    from bench.kit_triton import stage as stage_triton

    wheels = sorted((KIT / "wheels").glob("*.whl"))
    kit.site.mkdir(parents=True, exist_ok=True)
    if wheels:
        code = kit.run("stage", [kit.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                                 "--no-compile", "--disable-pip-version-check", "--target", str(kit.site),
                                 "--upgrade", *map(str, wheels)])
        if code:
            return False
    missing = missing_modules(kit)
    if missing:
        error = "the kit's Python cannot import what the phases need: " + "; ".join(missing)
        fix = ("add each missing package to CARRIED_WHEELS in bench/gpu_proof.py (or install it on this host), "
               "run `python3 bench/gpu_proof.py --prepare` where PyPI is reachable, and carry .kit again")
        kit.runner.record("stage", seconds=0.0, exit_code=2, error=error, fix=fix)
        kit.runner.say(f"error: {error}\n  fix: {fix}")
        return False
    if kit.rehearse:
        kit.runner.say("triton: not staged in a rehearsal (the CPU needs none)")
        return True
    try:
        kit.extra_env.update(stage_triton(KIT, kit.triton_site, kit.python))
    except KitTritonError as exc:
        kit.runner.record("stage", seconds=0.0, exit_code=2, error=str(exc), fix=exc.fix)
        kit.runner.say(f"error: {exc}\n  fix: {exc.fix}")
        return False
    kit.runner.say(f"triton: {kit.triton_site} staged first on PYTHONPATH, ptxas {kit.extra_env['TRITON_PTXAS_PATH']}")
    return True


def missing_modules(kit: Kit) -> list[str]:
    """Each of RUNTIME_MODULES the kit's interpreter cannot import, with its error."""
    probe = ("import importlib, json, sys\n"
             "bad = []\n"
             "for name in sys.argv[1:]:\n"
             "    try: importlib.import_module(name)\n"
             "    except Exception as exc: bad.append(f'{name} ({type(exc).__name__}: {exc})')\n"
             "print(json.dumps(bad))")
    try:
        proc = subprocess.run([kit.python, "-c", probe, *RUNTIME_MODULES], capture_output=True, text=True,
                              env=kit.env(), cwd=REPO, timeout=120)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return [f"the import probe itself failed ({type(exc).__name__}: {exc})"]


def compile_or_reuse(kit: Kit) -> int:
    """Compile the kernels, or install the wheels an earlier run compiled (carried in .kit/built)."""
    built = KIT / "built"
    lock = kit.results / "build.lock.json"
    if (built / "build.lock.json").is_file() and list(built.glob("*.whl")):
        kit.runner.say(f"compile: reusing the wheels carried in {built} (no compilation)")
        shutil.copyfile(built / "build.lock.json", lock)
        return kit.run("compile", [kit.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                                   "--no-compile", "--disable-pip-version-check", "--target", str(kit.site),
                                   "--upgrade", *map(str, sorted(built.glob("*.whl")))])
    code = kit.run("compile", [kit.python, "-m", "build", "kernels", "build-here", IMAGE, "--arch", ARCH,
                               "--cache", str(KIT / "cache"), "--out", str(kit.work / "kernels"), "--force",
                               "--install", str(kit.site), "--lock", str(lock)],
                   stdout_to=kit.results / "compile.json")
    if code == 0:   # they come back with the results: copy DIR/built to .kit/built to skip this next time
        out = kit.results / "built"
        out.mkdir(exist_ok=True)
        for wheel in (kit.work / "kernels" / "wheels").glob("*.whl"):
            shutil.copyfile(wheel, out / wheel.name)
        shutil.copyfile(lock, out / "build.lock.json")
    return code


REFUSAL = r'''
import json, sys, torch
from flash_attn import flash_attn_varlen_func
out = {}
cu = torch.tensor([0, 40, 64], dtype=torch.int32, device="cuda")
def attempt(name, head_dim, dtype, **kw):
    q = torch.randn(64, 2, head_dim, device="cuda", dtype=dtype)
    try:
        flash_attn_varlen_func(q, q, q, cu, cu, 40, 40, causal=True, **kw)
        torch.cuda.synchronize()
        out[name] = {"refused": False}
    except RuntimeError as exc:
        out[name] = {"refused": True, "error": str(exc).splitlines()[0][:300]}
attempt("compiled: head_dim 256 bf16", 256, torch.bfloat16)
attempt("head_dim 128 bf16", 128, torch.bfloat16)
attempt("head_dim 256 fp16", 256, torch.float16)
attempt("head_dim 256 bf16 dropout 0.1", 256, torch.bfloat16, dropout_p=0.1)
attempt("head_dim 256 bf16 sliding window", 256, torch.bfloat16, window_size=(16, 0))
attempt("head_dim 256 bf16 softcap", 256, torch.bfloat16, softcap=30.0)
from causal_conv1d import causal_conv1d_fn
def conv(name, dtype):
    x = torch.randn(1, 64, 97, device="cuda", dtype=dtype)
    w = torch.randn(64, 4, device="cuda", dtype=dtype)
    try:
        causal_conv1d_fn(x, w, None, activation="silu")
        torch.cuda.synchronize()
        out[name] = {"refused": False}
    except RuntimeError as exc:
        out[name] = {"refused": True, "error": str(exc).splitlines()[0][:300]}
conv("compiled: causal-conv1d bf16", torch.bfloat16)
conv("causal-conv1d fp16", torch.float16)
conv("causal-conv1d fp32", torch.float32)
ok = all(not v["refused"] for k, v in out.items() if k.startswith("compiled")) and \
    all(v["refused"] for k, v in out.items() if not k.startswith("compiled"))
out["all_as_expected"] = ok
json.dump(out, open(sys.argv[1], "w"), indent=2)
print(json.dumps(out, indent=2))
sys.exit(0 if ok else 1)
'''


def load(kit: Kit, name: str):
    try:
        return json.loads((kit.results / name).read_text())
    except (OSError, ValueError):
        return None


def summary(kit: Kit, info: dict) -> str:
    lines = [f"GPU proof kit, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {info.get('commit')}"
             f"{' (REHEARSAL: no GPU, nothing below proves a GPU path)' if kit.rehearse else ''}",
             f"machine: {info.get('gpu')}; {info.get('cores')} cores; {json.dumps(info.get('python'))}",
             "", f"{'phase':<26}{'seconds':>9}  result"]
    for phase, p in kit.runner.phases.items():
        result = p.get("skipped") or ("TIMED OUT" if p.get("timed_out") else f"exit {p.get('exit_code')}")
        lines.append(f"{phase:<26}{p.get('seconds', 0):>9}  {result}")
    lines.append(f"{'total':<26}{round(time.monotonic() - kit.runner.started, 1):>9}")
    compiled = load(kit, "compile.json")
    if compiled:
        lines.append("")
        for name, k in compiled.get("kernels", {}).items():
            failed = [c for c in k.get("checks", []) if c.endswith("FAIL")]
            checks = f"FAILED: {failed}" if failed else "pass"
            lines.append(f"compiled {name}: {k['seconds']}s with {k['jobs']} jobs, {k['wheel']} "
                         f"({k['wheel_bytes'] / 2 ** 20:.1f} MiB), checks {checks}")
    refusal = load(kit, "refusal.json")
    if refusal:
        lines.append("")
        for name, r in refusal.items():
            if isinstance(r, dict):
                lines.append(f"refusal  {name:<34} {'refused: ' + r.get('error', '')[:90] if r['refused'] else 'ran'}")
    report = load(kit, "verify.json")
    if report:
        lines += ["", f"verify: worst {report['worst']} (exit {report['exit_code']})"]
        for r in report["results"]:
            lines.append(f"  {r['check']:<42} {r['status']:<5} {r['detail'][:160]}")
    ft = load(kit, "finetune.json")
    if ft:
        lines += ["", f"finetune: {'PASS' if ft.get('ok') else 'FAIL'}"]
        for key in ("a_stopped", "a_resumed", "generate"):
            if key in ft:
                lines.append(f"  {key}: {json.dumps(ft[key], default=str)[:400]}")
        losses = ft.get("losses", {})
        lines.append(f"  fused vs fallback losses (padded, first steps): max relative difference "
                     f"{losses.get('max_rel_diff')}, tolerance {losses.get('tolerance')}, agree {losses.get('agree')}")
    bench = load(kit, "bench.json")
    if bench:
        from bench.gpu_bench import render

        lines += ["", render(bench)]
    from bench.kit_family import summary_lines

    lines += summary_lines(kit.results, [p.partition(":")[2] for p in family_phases()])
    return "\n".join(lines) + "\n"


def carried_size() -> tuple[int, list[str]]:
    """What travels to the GPU host: the working tree as git sees it (tracked and untracked, not
    ignored) plus the ignored .kit folder, which the call carries explicitly."""
    proc = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                          capture_output=True, text=True)
    files = [REPO / f for f in proc.stdout.split("\0") if f]
    files += [p for p in KIT.rglob("*") if p.is_file()] if KIT.is_dir() else []
    sizes = sorted(((p.stat().st_size, str(p.relative_to(REPO))) for p in files if p.is_file()), reverse=True)
    return sum(s for s, _ in sizes), [f"{n} ({s / 2 ** 20:.1f} MiB)" for s, n in sizes[:5]]


def prepare() -> int:
    """Fetch what must travel (on a machine with network): the pinned kernel sources, the
    pure-Python wheels the GPU host lacks, and the trimmed Triton."""
    from bench.kit_triton import prepare as prepare_triton

    env = {**os.environ, "FTIMAGE_CACHE": str(KIT / "cache")}
    code = subprocess.run([sys.executable, "-m", "build", "kernels", "fetch", IMAGE, "--cache", str(KIT / "cache")],
                          cwd=REPO, env=env).returncode
    if code:
        return code
    # fetched afresh into a staging folder, then swapped in: one version of each, for the host's Python
    staging = KIT / "wheels.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    code = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--python-version", HOST_PYTHON, "--implementation", "cp", "--platform", "any",
                           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
                           "--dest", str(staging), *CARRIED_WHEELS]).returncode
    if code:
        shutil.rmtree(staging, ignore_errors=True)
        return code
    shutil.rmtree(KIT / "wheels", ignore_errors=True)
    staging.rename(KIT / "wheels")
    if not (KIT / "triton" / "manifest.json").is_file():
        prepare_triton(KIT)
    size, largest = carried_size()
    print(f"the working tree and .kit carry {size / 2 ** 20:.1f} MiB (limit {CARRY_LIMIT >> 20} MiB); largest: "
          + ", ".join(largest))
    return 0 if size <= CARRY_LIMIT else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=None,
                   help="results folder (default: $FTIMAGE_PROOF_OUT, else $OUT, else out/gpu-proof)")
    p.add_argument("--rehearse", action="store_true", help="run every step that needs no GPU, on this machine")
    p.add_argument("--prepare", action="store_true", help="fetch the sources and wheels that must travel")
    p.add_argument("--python", default=os.environ.get("PYTHON", sys.executable),
                   help="the interpreter whose torch the kernels are built for (default: this one)")
    p.add_argument("--deadline", type=float, default=DEADLINE, help="seconds for the whole kit (default 530)")
    p.add_argument("--skip", action="append", default=[], choices=(*PHASES, *family_phases()))
    p.add_argument("--families", help="comma-separated: run only these families' phases (default: every family)")
    p.add_argument("--again", action="store_true", help="run phases that already passed in this results folder")
    args = p.parse_args(argv)
    if args.prepare:
        return prepare()
    known = [p.partition(":")[2] for p in family_phases()]
    if args.families and (unknown := sorted(set(args.families.split(",")) - set(known))):
        print(f"error: unknown families {', '.join(unknown)}\n  fix: choose from {','.join(known)}", file=sys.stderr)
        return 2
    results = args.results or Path(os.environ.get("FTIMAGE_PROOF_OUT") or os.environ.get("OUT") or "out/gpu-proof")
    try:
        runner = Runner(results.resolve(), deadline_s=args.deadline)
    except ResultsNotWritable as exc:
        print(f"error: {exc}\n  fix: {exc.fix}", file=sys.stderr)
        return 2
    kit = Kit(runner, args.python, args.rehearse)
    info = machine(kit)
    try:
        def wanted(phase: str) -> bool:
            if phase in args.skip:
                runner.skip(phase, f"--skip {phase}")
                return False
            if runner.done(phase) and not args.again:
                runner.say(f"=== {phase}: passed in an earlier run (kept; --again reruns it)")
                return False
            return True

        staged = stage(kit)
        if wanted("compile"):
            if not staged:
                runner.skip("compile", "the stage phase failed (its error is in phases.json)")
            elif kit.rehearse:   # a CPU torch cannot link a CUDA extension; image builds run the same recipe
                runner.skip("compile", "no CUDA torch here (rehearsal)")
            else:
                compile_or_reuse(kit)
        if wanted("refusal"):
            if kit.rehearse:
                runner.skip("refusal", "no GPU (rehearsal)")
            else:
                kit.run("refusal", [kit.python, "-c", REFUSAL, str(kit.results / "refusal.json")])
        if wanted("verify"):
            kit.run("verify", [kit.python, "-m", "verify", "--json-file", str(kit.results / "verify.json"),
                               *(["--device", "cpu"] if kit.rehearse else [])])
        if wanted("finetune"):
            kit.run("finetune", [kit.python, "bench/kit_finetune.py", "--work", str(kit.work / "finetune"),
                                 "--json-out", str(kit.results / "finetune.json"),
                                 *(["--rehearse"] if kit.rehearse else [])])
        if wanted("bench"):
            kit.run("bench", [kit.python, "bench/gpu_bench.py", "--json-out", str(kit.results / "bench.json"),
                              *(["--dry-run"] if kit.rehearse else [])])
        chosen = set(args.families.split(",")) if args.families else None
        for phase in family_phases():
            name = phase.partition(":")[2]
            if chosen is not None and name not in chosen:
                continue
            if wanted(phase):
                kit.run(phase, [kit.python, "bench/kit_family.py", name, "--lock", str(kit.results / "build.lock.json"),
                                "--json-out", str(kit.results / f"family-{name}.json"),
                                *(["--rehearse"] if kit.rehearse else [])])
    finally:
        text = summary(kit, info)
        (kit.results / "summary.txt").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
