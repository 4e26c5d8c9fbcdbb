#!/usr/bin/env bash
# Runs INSIDE the builder container, with networking disabled.
#   /in   (read-only): wheels/ + requirements.txt (pinned torch + CUDA toolchain + build deps,
#         hash-locked), src/<sdist>, patches/*.patch, check.py, check.json
#   /out  (read-write): dist/<wheel>, observed.json, checks.txt
#   /ccache: a named volume, so a rebuild after a killed compile reuses finished objects
# Env: SDIST, CUDA_PIP_DIR (e.g. cu13), MAX_JOBS, NVCC_THREADS, plus the kernel's build_env
# (its FORCE_BUILD knob and its arch knob).
set -euo pipefail
export HOME=/tmp PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

echo "ftimage: installing the pinned torch and CUDA toolchain (hash-checked, offline)"
python3 -m venv /tmp/venv
/tmp/venv/bin/python -m pip install --quiet --no-index --no-deps --require-hashes --no-cache-dir \
    --find-links /in/wheels -r /in/requirements.txt

# NVIDIA's pip wheels unpack into site-packages/nvidia/cu<major>; torch's cpp_extension
# wants a classic CUDA_HOME layout: lib64 and an unversioned libcudart.so (without it the
# link fails with "cannot find -lcudart").
site=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export CUDA_HOME="$site/nvidia/$CUDA_PIP_DIR"
[ -e "$CUDA_HOME/lib64" ] || ln -s lib "$CUDA_HOME/lib64"
[ -e "$CUDA_HOME/lib/libcudart.so" ] || ln -s "$(cd "$CUDA_HOME/lib" && ls libcudart.so.* | head -n1)" "$CUDA_HOME/lib/libcudart.so"
export PATH="$CUDA_HOME/bin:/tmp/venv/bin:$PATH"
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
python - <<'EOF' > /out/observed.json
import json, re, subprocess, torch
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
release = re.search(r"release (\d+\.\d+)", nvcc)
gcc = subprocess.run(["gcc", "-dumpversion"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "nvcc": release.group(1) if release else "?", "compiler": f"gcc-{gcc.split('.')[0]}",
                  "compiler_version": gcc}))
EOF

# Import/ABI and entry-point checks against the pinned torch, before the wheel may enter the cache.
python -m pip install --quiet --no-index --no-deps --no-cache-dir /out/dist/*.whl
cd /tmp
python /in/check.py "$(cat /in/check.json)" | tee /out/checks.txt
