"""GPU proof kit: on a bare GPU host (no Docker, no network), compile the pinned kernels with the
project's own recipe, then prove the fused forward and backward paths, packed isolation and
the speed-up, in one command.

    python3 bench/gpu_proof.py [--results DIR]          # on the GPU host, from the repo root
    python3 bench/gpu_proof.py --rehearse [--python PY]  # here: every step that needs no GPU
    python3 bench/gpu_proof.py --prepare                 # fetch what must travel into .kit/

Phases, each writing its result file as soon as it ends (a timeout late in the run keeps the
earlier results; at most 8 small files in the results folder):
  1 stage     install the carried pure-Python wheels (.kit/wheels) into a --target folder
  2 compile   `python -m build kernels build-here images/qwen27b --arch sm_90`: the pinned sdists
              and patches from .kit/cache, the image's knobs and specialisation, the same wheel
              checks (ABI import, entry points, SASS for sm_90 and nothing else) -> compile.json,
              and a lock for this environment -> build.lock.json
  3 refusal   the specialised flash-attn refuses what it was not compiled for (GPU) -> refusal.json
  4 verify    `python -m verify` against that lock: environment, model fit, dispatch, fused fwd+bwd
              with profiler kernel names, isolation with its negative control -> verify.json
  5 bench     bench/gpu_bench.py: fused vs fallback, packed vs padded -> bench.json
  6 summary   one table -> summary.txt (and phases.json: each phase's seconds and status)

What this proves, and what it does not: see verify/README.md ("Proof on a GPU host").
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
KIT = REPO / ".kit"
IMAGE = "images/qwen27b"
ARCH = "sm_90"
CARRY_LIMIT = 64 << 20
# Pure-Python wheels the GPU host lacks (pinned here: the kit installs them with --no-deps).
CARRIED_WHEELS = ("pyelftools==0.32",)
PHASE_TIMEOUTS = {"compile": 330, "refusal": 90, "verify": 240, "bench": 330}


class Kit:
    def __init__(self, results: Path, python: str, rehearse: bool):
        self.results = results
        self.python = python
        self.rehearse = rehearse
        self.work = Path(os.environ.get("FTIMAGE_PROOF_WORK", "/tmp/ftimage-proof"))
        self.site = self.work / "site"
        self.phases: dict[str, dict] = {}
        self.started = time.monotonic()
        results.mkdir(parents=True, exist_ok=True)
        self.log = (results / "kit.log").open("a")

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{self.site}{os.pathsep}{REPO}", "PYTHONUNBUFFERED": "1",
                "TRITON_CACHE_DIR": str(self.work / "triton"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TRANSFORMERS_VERBOSITY": "error", "FTIMAGE_CACHE": str(KIT / "cache")}

    def run(self, phase: str, argv: list[str], *, stdout_to: Path | None = None) -> int:
        """Run one phase's command, streaming its output to the log; record time and status."""
        self.say(f"=== {phase}: {' '.join(argv)}")
        started = time.monotonic()
        timeout = PHASE_TIMEOUTS.get(phase, 300)
        out = stdout_to.open("w") if stdout_to else None
        try:
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env(), stdout=out or subprocess.PIPE,
                                    stderr=subprocess.STDOUT if out is None else subprocess.PIPE, text=True)
            stream = proc.stdout if out is None else proc.stderr
            for line in stream:
                self.log.write(line)
                if not line.startswith(("USDT:", "STAGE:")):
                    sys.stdout.write(line)
            code = proc.wait(timeout=max(1, timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = 124
        finally:
            if out:
                out.close()
            self.log.flush()
        seconds = round(time.monotonic() - started, 1)
        self.phases[phase] = {"seconds": seconds, "exit_code": code}
        self.say(f"=== {phase}: exit {code} after {seconds}s")
        (self.results / "phases.json").write_text(json.dumps(self.phases, indent=2))
        return code

    def skip(self, phase: str, why: str) -> None:
        self.phases[phase] = {"seconds": 0.0, "exit_code": None, "skipped": why}
        self.say(f"=== {phase}: skipped ({why})")
        (self.results / "phases.json").write_text(json.dumps(self.phases, indent=2))


def machine(kit: Kit) -> dict:
    info = {"platform": platform.platform(), "cores": os.cpu_count()}
    try:
        query = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total", "--format=csv,noheader"]
        info["gpu"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = "none (no nvidia-smi)"
    probe = ("import json, sys, shutil, sysconfig, os, importlib.metadata as md\n"
             "v = {}\n"
             "for n in ('torch', 'transformers', 'triton', 'einops', 'ninja', 'setuptools', 'wheel'):\n"
             "    try: v[n] = md.version(n)\n"
             "    except md.PackageNotFoundError: v[n] = None\n"
             "v['python'] = sys.version.split()[0]\n"
             "v['python_h'] = os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))\n"
             "v['cc'] = shutil.which('gcc') or shutil.which('cc'); v['nvcc'] = shutil.which('nvcc')\n"
             "print(json.dumps(v))")
    out = subprocess.run([kit.python, "-c", probe], capture_output=True, text=True)
    info["python"] = json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}
    kit.say(f"machine: {json.dumps(info)}")
    return info


def stage(kit: Kit) -> None:
    wheels = sorted((KIT / "wheels").glob("*.whl"))
    carried = sum(f.stat().st_size for f in KIT.rglob("*") if f.is_file()) if KIT.is_dir() else 0
    kit.say(f"carried: {carried / 2 ** 20:.1f} MiB in .kit (limit {CARRY_LIMIT >> 20} MiB); wheels: "
            f"{', '.join(w.name for w in wheels) or 'none'}")
    kit.site.mkdir(parents=True, exist_ok=True)
    if wheels:
        kit.run("stage", [kit.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                          "--disable-pip-version-check", "--target", str(kit.site), *map(str, wheels)])
    kit.phases.setdefault("stage", {})["carried_mib"] = round(carried / 2 ** 20, 2)


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


def summary(kit: Kit, info: dict) -> str:
    def load(name):
        path = kit.results / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    lines = [f"GPU proof kit, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
             f"{' (REHEARSAL: no GPU, nothing below proves a GPU path)' if kit.rehearse else ''}",
             f"machine: {info.get('gpu')}; {info.get('cores')} cores; python {info.get('python', {}).get('python')}, "
             f"torch {info.get('python', {}).get('torch')}, transformers {info.get('python', {}).get('transformers')}",
             "", "phase      seconds  exit"]
    for phase, p in kit.phases.items():
        lines.append(f"{phase:<10}{p.get('seconds', 0):>8}  {p.get('skipped') or p.get('exit_code')}")
    lines.append(f"{'total':<10}{round(time.monotonic() - kit.started, 1):>8}")
    compile_ = load("compile.json")
    if compile_:
        lines.append("")
        for name, k in compile_.get("kernels", {}).items():
            failed = [c for c in k.get("checks", []) if c.endswith("FAIL")]
            verdict = f"FAILED: {failed}" if failed else "pass"
            lines.append(f"compiled {name}: {k['seconds']}s with {k['jobs']} jobs, {k['wheel']} "
                         f"({k['wheel_bytes'] / 2 ** 20:.1f} MiB), checks {verdict}")
    refusal = load("refusal.json")
    if refusal:
        lines.append("")
        for name, r in refusal.items():
            if isinstance(r, dict):
                lines.append(f"refusal  {name:<34} {'refused: ' + r.get('error', '')[:90] if r['refused'] else 'ran'}")
    report = load("verify.json")
    if report:
        lines += ["", f"verify: worst {report['worst']} (exit {report['exit_code']})"]
        for r in report["results"]:
            lines.append(f"  {r['check']:<42} {r['status']:<5} {r['detail'][:160]}")
    bench = load("bench.json")
    if bench:
        sys.path.insert(0, str(REPO))
        from bench.gpu_bench import render
        lines += ["", render(bench)]
    return "\n".join(lines) + "\n"


def prepare() -> int:
    """Fetch what must travel (run on a machine with network): the pinned sources of the image's
    kernels into .kit/cache, and the pure-Python wheels the GPU host lacks into .kit/wheels."""
    env = {**os.environ, "FTIMAGE_CACHE": str(KIT / "cache")}
    code = subprocess.run([sys.executable, "-m", "build", "kernels", "fetch", IMAGE, "--cache", str(KIT / "cache")],
                          cwd=REPO, env=env).returncode
    if code:
        return code
    (KIT / "wheels").mkdir(parents=True, exist_ok=True)
    for req in CARRIED_WHEELS:
        code = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                               "--dest", str(KIT / "wheels"), req]).returncode
        if code:
            return code
    size = sum(f.stat().st_size for f in KIT.rglob("*") if f.is_file())
    print(f".kit holds {size / 2 ** 20:.1f} MiB (limit {CARRY_LIMIT >> 20} MiB)")
    return 0 if size <= CARRY_LIMIT else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=None,
                   help="results folder (default: $FTIMAGE_PROOF_OUT, else $OUT, else out/gpu-proof)")
    p.add_argument("--rehearse", action="store_true", help="run every step that needs no GPU, on this machine")
    p.add_argument("--prepare", action="store_true", help="fetch the sources and wheels that must travel")
    p.add_argument("--python", default=os.environ.get("PYTHON", "python3"),
                   help="the interpreter whose torch the kernels are built for (default: python3)")
    p.add_argument("--skip", action="append", default=[], choices=("compile", "refusal", "verify", "bench"),
                   help="skip a phase (e.g. rerun only a late one in the same warm session)")
    p.add_argument("--verify-checks", default="", help="only these verify checks (comma-separated)")
    args = p.parse_args(argv)
    if args.prepare:
        return prepare()
    results = args.results or Path(os.environ.get("FTIMAGE_PROOF_OUT") or os.environ.get("OUT") or "out/gpu-proof")
    kit = Kit(results.resolve(), args.python, args.rehearse)
    info = machine(kit)
    lock = kit.results / "build.lock.json"
    kept = kit.work / "build.lock.json"   # survives a rerun in the same session (results are emptied)
    if "compile" in args.skip:
        kit.skip("compile", "--skip compile")
        if kept.is_file() and not lock.is_file():
            shutil.copyfile(kept, lock)
    else:
        shutil.rmtree(kit.site, ignore_errors=True)
        stage(kit)
        kit.run("compile", [kit.python, "-m", "build", "kernels", "build-here", IMAGE, "--arch", ARCH,
                            "--cache", str(KIT / "cache"), "--out", str(kit.work / "kernels"), "--force",
                            "--install", str(kit.site), "--lock", str(lock)],
                stdout_to=kit.results / "compile.json")
        if lock.is_file():
            shutil.copyfile(lock, kept)
    if kit.rehearse or "refusal" in args.skip:
        kit.skip("refusal", "no GPU (rehearsal)" if kit.rehearse else "--skip refusal")
    else:
        kit.run("refusal", [kit.python, "-c", REFUSAL, str(kit.results / "refusal.json")])
    if "verify" in args.skip:
        kit.skip("verify", "--skip verify")
    else:
        device = ["--device", "cpu"] if kit.rehearse else []
        only = ["--checks", args.verify_checks] if args.verify_checks else []
        kit.run("verify", [kit.python, "-m", "verify", "--lock", str(lock), "--json-file",
                           str(kit.results / "verify.json"), *device, *only])
    if "bench" in args.skip:
        kit.skip("bench", "--skip bench")
    else:
        kit.run("bench", [kit.python, "bench/gpu_bench.py", "--json-out", str(kit.results / "bench.json"),
                          *(["--dry-run"] if kit.rehearse else [])])
    text = summary(kit, info)
    (kit.results / "summary.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
