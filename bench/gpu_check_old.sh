#!/usr/bin/env bash
# GPU evidence for verify/: the fused forward AND backward paths run, numerics match the torch
# reference, packed documents stay isolated; plus fused-vs-fallback op counts and step time.
#
# Target: one CUDA GPU (planned: H200, torch 2.11.0+cu130, transformers 5.17, triton 3.6, NO
# network), from the repo root, with the kernel wheels (fla-core / flash-linear-attention,
# causal-conv1d, optionally flash-attn) in .whl/. With the session's `run` tool:
#     run(command="bash verify/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Budget: < 10 min. Results go to $OUT (default out/gpu_check): 7 small files (gpu_check.log,
# build.lock.json, verify_{static,fused,isolation}.json, opcount_{fused,fallback}.json), because
# the device tool brings back at most 8; the --target site and Triton cache live in /tmp.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/out/gpu_check}
WORK=${WORK:-/tmp/ftimage_gpu_check}
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-$(command -v python3 || command -v python)}
exec > >(tee "$OUT/gpu_check.log") 2>&1
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
T0=$(date +%s)

step "machine"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
CC_FOUND=""; for c in "${CC:-}" gcc clang cc; do [ -n "$c" ] && command -v "$c" >/dev/null && { CC_FOUND=$(command -v "$c"); break; }; done
echo "C compiler: ${CC_FOUND:-NONE (Triton needs one to build its launcher)}"
"$PY" - <<'PYEOF'
import sys, sysconfig, os
print("python", sys.version.split()[0], "Python.h:", os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
for name in ("torch", "transformers", "triton", "einops", "flash_attn"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "NOT importable:", type(exc).__name__, exc)
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF

step "install the carried wheels into a --target dir (no index, no deps: the box is offline)"
SITE="$WORK/site"
rm -rf "$SITE"; mkdir -p "$SITE"
shopt -s nullglob
WHEELS=(.whl/*.whl)
if [ ${#WHEELS[@]} -eq 0 ]; then
  echo "no wheels in .whl/ (did the run carry .whl?); verify will report the torch fallback"
else
  ls -l "${WHEELS[@]}"
  "$PY" -m pip install --no-index --no-deps --no-compile --target "$SITE" "${WHEELS[@]}" 2>&1 | tail -3 \
    || echo "pip install failed"
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="$WORK/triton-cache"
mkdir -p "$TRITON_CACHE_DIR"

step "lock for this environment (wheel sha256s recorded)"
LOCK_ARGS=()
for w in "${WHEELS[@]}"; do
  dist=$(basename "$w" | cut -d- -f1 | tr '_' '-' | tr 'A-Z' 'a-z')
  LOCK_ARGS+=(--wheel "$dist=$w")
done
"$PY" -m verify.envlock --out "$OUT/build.lock.json" "${LOCK_ARGS[@]}"
"$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('kernels:', [(k['name'], k['version'], k['kind']) for k in d['kernels']], 'attn:', d['attn_implementation'], 'archs:', d['target_archs'])" "$OUT/build.lock.json"

# verify runs in three invocations so that a timeout in one (first-use Triton JIT and autotuning
# can take minutes) still leaves the others' JSON in $OUT. Together they are `python -m verify`.
run_verify() {  # name, timeout, checks
  step "python -m verify --checks $3"
  timeout "$2" "$PY" -m verify --checks "$3" --lock "$OUT/build.lock.json" --json-file "$OUT/verify_$1.json"
  echo "verify --checks $3 exit code: $? (0 pass, 1 warn, 2 fail; 124 = timed out)"
}
run_verify static 120 environment,dispatch
run_verify fused 240 fused_ops
run_verify isolation 120 isolation

step "op counts and step time: fused"
timeout 75 "$PY" -m verify.opcount --steps 20 --out "$OUT/opcount_fused.json" || echo "opcount (fused) failed: $?"
step "op counts and step time: fallback (fla and causal_conv1d made unimportable, sdpa)"
timeout 75 "$PY" -m verify.opcount --steps 20 --fallback --out "$OUT/opcount_fallback.json" || echo "opcount (fallback) failed: $?"

step "summary"
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
worst = []
for part in ("static", "fused", "isolation"):
    report = load(f"verify_{part}.json")
    if not report:
        print(f"verify {part}: no result (timed out or crashed; see the log)"); worst.append(2); continue
    worst.append(report["exit_code"])
    print(f"verify {part}: worst {report['worst']} (exit {report['exit_code']})")
    for r in report["results"]:
        if r["status"] != "PASS" or r["check"].startswith(("isolation.", "fused_ops.")):
            print(f"  {r['check']:<38} {r['status']:<5} {r['detail'][:150]}")
print("verify overall exit code:", max(worst))
for mode in ("fused", "fallback"):
    res = load(f"opcount_{mode}.json")
    if not res:
        print(mode, ": no result"); continue
    print(f"{mode:>8}: {res['step_ms']} ms/step, {res['kernel_launches_per_step']} launches/step "
          f"({res['forward_launches']} fwd, {res['backward_launches']} bwd), attn {res['attn_implementation'][:40]}")
    for op, c in res["ops"].items():
        print(f"          {op}: {c}")
PYEOF
echo "total wall: $(( $(date +%s) - T0 )) s"
