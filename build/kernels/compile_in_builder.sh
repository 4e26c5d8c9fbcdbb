#!/usr/bin/env bash
# Runs INSIDE the kernel builder image (build/templates/Dockerfile.builder.j2), with
# networking disabled. The image already holds the pinned torch and CUDA toolchain.
#   /in   (read-only): src/<sdist>, patches/*.patch, check.py, check.json
#   /out  (read-write): dist/<wheel>, observed.json
#   /ccache: a named volume, so a rebuild after a killed compile reuses finished objects
# Env: SDIST, MAX_JOBS, NVCC_THREADS, plus the kernel's build_env (its FORCE_BUILD knob
# and its arch knob).
set -euo pipefail
export HOME=/tmp PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
nvcc --version | tail -n 2

mkdir -p /tmp/src
tar -xzf "/in/src/$SDIST" -C /tmp/src --strip-components=1
cd /tmp/src
for patch_file in /in/patches/*.patch; do
    [ -e "$patch_file" ] || continue
    echo "ftimage: applying $(basename "$patch_file")"
    patch -p1 --forward --batch < "$patch_file"
done

# ccache in front of nvcc only: torch's cpp_extension honours PYTORCH_NVCC.
export CCACHE_DIR=/ccache CCACHE_MAXSIZE=5G PYTORCH_NVCC="ccache $CUDA_HOME/bin/nvcc"
echo "ftimage: compiling with MAX_JOBS=$MAX_JOBS NVCC_THREADS=$NVCC_THREADS"
start=$(date +%s)
python -m pip wheel --no-index --no-deps --no-build-isolation --no-cache-dir --wheel-dir /out/dist . 2>&1
echo "ftimage: compiled in $(( $(date +%s) - start ))s"

# Record what the wheel was really built with, for the version checks on the host.
python - <<'PY' > /out/observed.json
import json, re, subprocess, torch
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
release = re.search(r"release (\d+\.\d+)", nvcc)
gcc = subprocess.run(["gcc", "-dumpversion"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "nvcc": release.group(1) if release else "?", "compiler": f"gcc-{gcc.split('.')[0]}",
                  "compiler_version": gcc}))
PY

# Import/ABI and entry-point checks against the pinned torch, before the wheel may enter
# the cache. Installed into a throwaway target so the builder image stays unchanged.
python -m pip install --quiet --no-index --no-deps --no-cache-dir --target /tmp/checked /out/dist/*.whl
cd /tmp
PYTHONPATH=/tmp/checked python /in/check.py "$(cat /in/check.json)"
