"""Kernel tier: real nvcc compiles in a builder container, real GPU-free checks, real cache safety.

causal-conv1d is compiled once per session for sm_90 (images/kernel-smoke, ~10 min on 2
cores) and reused; failure paths use tests/kernel/testkernel, a tiny real CUDA extension.
"""
from __future__ import annotations

import copy
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from build.cache import CacheLayout, default_cache_root, sha256_file
from build.kernels.store import KernelStore
from build.resolve import load_plan
from build.spec import REPO_ROOT
from tests.conftest import run_build_cli

pytestmark = pytest.mark.kernel
TESTKERNEL = Path(__file__).resolve().parent / "testkernel"


def _kernel_entry(plan_dir: Path, name: str):
    plan = load_plan(plan_dir)
    kernel = next(k for k in plan.kernels if k.name == name)
    return kernel, KernelStore(CacheLayout(default_cache_root())).get(kernel.key)


def test_kernel_smoke_compiles_checks_and_caches(kernel_smoke):
    first, second = kernel_smoke["first"], kernel_smoke["second"]
    assert first["cache"]["kernel:causal-conv1d"].startswith(("miss (compiled", "hit local"))
    kernel, entry = _kernel_entry(REPO_ROOT / "images" / "kernel-smoke", "causal-conv1d")
    assert entry is not None, "the compiled wheel must be in the cache"
    assert entry.meta["archs"]["sass"] == ["sm_90"]          # patched gencodes: sm_90 only
    assert entry.meta["observed"]["torch"] == "2.14.1+cu130"   # torch.__version__ of the pinned wheel
    assert entry.meta["observed"]["nvcc"] == "13.0"
    assert entry.meta["inputs"] == json.loads(json.dumps(kernel.key_inputs))
    lock = json.loads((kernel_smoke["out"] / "build.lock.json").read_text())
    locked = next(k for k in lock["kernels"] if k["name"] == "causal-conv1d")
    assert locked["sha256"] == entry.sha256 and locked["key"] == kernel.key
    sbom = json.loads((kernel_smoke["out"] / "sbom.cdx.json").read_text())
    assert any(c["name"] == "causal-conv1d" and c["hashes"][0]["content"] == entry.sha256
               for c in sbom["components"])
    # Second run: zero compilation, and the image itself is reused.
    assert second["cache"]["kernel:causal-conv1d"] == "hit local"
    assert second["cache"]["image"] == "hit"
    assert second["image_id"] == first["image_id"]


def test_plan_shows_compile_cost_and_cache_state(kernel_smoke, tmp_path):
    proc = run_build_cli("images/kernel-smoke", "--plan")
    assert proc.returncode == 0
    for name in ("causal-conv1d", "flash-attn"):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        assert " hit " in row and "0s (cached)" in row, row
    # an empty cache: a miss, with the specialised estimate (sources to compile, jobs on this host)
    proc = run_build_cli("images/qwen27b", "--plan", "--cache", str(tmp_path / "empty"))
    row = next(line for line in proc.stdout.splitlines() if line.startswith("flash-attn"))
    assert " miss " in row and "7 sources" in row and "hdim 256, bf16" in row, row


def test_image_reruns_checks_inside(engine, kernel_smoke):
    tag = kernel_smoke["first"]["tag"]
    result = engine.run(tag, ["-c", "import torch, causal_conv1d_cuda as m; print(sorted(n for n in dir(m) "
                              "if n.startswith('causal')))"], entrypoint=["python"], timeout=300)
    assert result.exit_code == 0, result.output
    assert "causal_conv1d_bwd" in result.output and "causal_conv1d_fwd" in result.output
    assert engine.run(tag, ["id", "-u"], timeout=60).output.strip() == "10001"
    # link-time static archives (Triton's CUPTI, cudart_static) are not shipped
    found = engine.run(tag, ["-c", "find /opt/ftimage/venv -name '*.a' | head -3; python -c 'import triton'"],
                       entrypoint=["sh"], timeout=120)
    assert found.exit_code == 0 and found.output.strip() == "", found.output


def test_every_verify_row_of_the_kernel_image_is_a_verdict_not_a_crash(engine, kernel_smoke):
    """kernel-smoke ships no transformers: the rows that prove dispatch through its modeling code
    fail closed with that reason, and every environment row that needs no GPU passes."""
    from tests.fixtures.verify_rows import environment_rows_that_do_not_pass, report_from_output

    result = engine.run(kernel_smoke["first"]["tag"], ["verify", "--json"], network="none", timeout=900)
    report = report_from_output(result.output)
    assert environment_rows_that_do_not_pass(report) == []
    rows = {r["check"]: r for r in report["results"]}
    assert rows["environment.transformers"]["status"] == "SKIP"
    assert rows["environment.torch"]["status"] == "PASS" and rows["environment.torch_cuda"]["detail"] == "13.0"
    for kernel in ("causal-conv1d", "flash-attn"):
        assert rows[f"environment.kernel.{kernel}"]["status"] == "PASS"
    for name in ("dispatch", "isolation", "fused_ops"):
        assert rows[name]["status"] == "FAIL" and "transformers is not installed" in rows[name]["detail"]


def test_abi_mismatch_is_caught_and_named(kernel_smoke, smoke_image):
    """The causal-conv1d wheel built against torch 2.14.1+cu130, imported beside the smoke
    image's torch 2.13.0+cpu: the import/ABI check fails and names what is missing."""
    _, entry = _kernel_entry(REPO_ROOT / "images" / "kernel-smoke", "causal-conv1d")
    proc = run_build_cli("kernels", "check", str(entry.wheel), "--image", smoke_image, "--kernel", "causal-conv1d")
    assert proc.returncode == 1
    assert "import/ABI" in proc.stderr and "FAIL" in proc.stderr
    assert "built against a different torch/ABI" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_same_wheel_passes_beside_its_own_torch(kernel_smoke):
    _, entry = _kernel_entry(REPO_ROOT / "images" / "kernel-smoke", "causal-conv1d")
    proc = run_build_cli("kernels", "check", str(entry.wheel), "--image", kernel_smoke["first"]["tag"],
                         "--kernel", "causal-conv1d")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_missing_manifest_entry_point_fails(kernel_smoke, tmp_path):
    manifest = yaml.safe_load((REPO_ROOT / "kernels_manifest.yaml").read_text())
    manifest["kernels"]["causal-conv1d"]["entry_points"]["backward"] = ["causal_conv1d_bwd", "causal_conv1d_bwd_v9"]
    (tmp_path / "kernels_manifest.yaml").write_text(yaml.safe_dump(manifest))
    _, entry = _kernel_entry(REPO_ROOT / "images" / "kernel-smoke", "causal-conv1d")
    proc = run_build_cli("kernels", "check", str(entry.wheel), "--image", kernel_smoke["first"]["tag"],
                         "--kernel", "causal-conv1d", "--manifest", str(tmp_path / "kernels_manifest.yaml"))
    assert proc.returncode == 1
    assert "missing: causal_conv1d_bwd_v9" in proc.stderr


def test_export_import_verifies_hashes(kernel_smoke, tmp_path):
    from tests.fixtures.keys import write_p256_pair

    private, public = write_p256_pair(tmp_path)
    export = tmp_path / "export"
    assert run_build_cli("kernels", "export", str(export), "--sign", str(private)).returncode == 0
    _, entry = _kernel_entry(REPO_ROOT / "images" / "kernel-smoke", "causal-conv1d")
    assert (export / entry.key / entry.meta["wheel"]).is_file()
    fresh = tmp_path / "fresh-cache"
    proc = run_build_cli("kernels", "import", str(export), "--cache", str(fresh), "--key", str(public))
    assert proc.returncode == 0, proc.stderr
    assert KernelStore(CacheLayout(fresh)).get(entry.key).sha256 == entry.sha256
    # A tampered export is refused and never enters the cache.
    wheel = export / entry.key / entry.meta["wheel"]
    with open(wheel, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\0tampered\0")
    other = tmp_path / "other-cache"
    proc = run_build_cli("kernels", "import", str(export), "--cache", str(other), "--key", str(public))
    assert proc.returncode == 3
    assert f"refused {entry.key}" in proc.stderr
    assert KernelStore(CacheLayout(other)).get(entry.key) is None


# ---- failure paths with the tiny test kernel ----------------------------------------

DANGLING_BWD = b"""template <int HeadDim> void run_mha_bwd_(float* data, int64_t n);
torch::Tensor scale_bwd(torch::Tensor grad, double factor) {
  auto g = grad.contiguous().clone();
  run_mha_bwd_<128>(g.data_ptr<float>(), g.numel());  // the specialisation compiled only <256>
  return g;
}"""
DANGLING_CU = b"""
template <int HeadDim> void run_mha_bwd_(float* data, int64_t n) { launch_scale(data, n, 1.0f); }
template void run_mha_bwd_<256>(float*, int64_t);
"""


def _testkernel_workspace(tmp: Path, *, version: str, hardcoded_arch: str | None = None,
                          old_cxx_abi: bool = False, dangling_instantiation: bool = False) -> Path:
    """An image + manifest that build tests/kernel/testkernel; its sdist is pre-staged in the cache
    (the manifest's URL is never fetched)."""
    tmp.mkdir(parents=True, exist_ok=True)
    top = f"ftimage_testkernel-{version}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(TESTKERNEL.iterdir()):
            data = path.read_bytes()
            if path.name == "setup.py":
                data = data.replace(b'version="0.1.0"', f'version="{version}"'.encode())
                if hardcoded_arch:
                    data = data.replace(b"HARDCODED_ARCH = None", f'HARDCODED_ARCH = "{hardcoded_arch}"'.encode())
            if path.name == "binding.cpp" and old_cxx_abi:
                # The pre-C++11 std::string ABI, as a wrong-flavour prebuilt wheel has
                # (flash-attention #853): torch's own symbols then no longer resolve.
                data = b"#undef _GLIBCXX_USE_CXX11_ABI\n#define _GLIBCXX_USE_CXX11_ABI 0\n" + data
            if dangling_instantiation and path.name == "binding.cpp":
                # What a specialisation patch that trims the sources but not every dispatch
                # site leaves behind (flash-attn's HEADDIM_SWITCH): a reference to a template
                # instantiation that no compiled file provides. A shared object links anyway.
                old = b"torch::Tensor scale_bwd(torch::Tensor grad, double factor) { return scale_fwd(grad, factor); }"
                assert old in data
                data = data.replace(old, DANGLING_BWD)
            if dangling_instantiation and path.name == "kernel.cu":
                data += DANGLING_CU
            info = tarfile.TarInfo(f"{top}/{path.name}")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    sdist = tmp / f"{top}.tar.gz"
    sdist.write_bytes(buffer.getvalue())
    sha = sha256_file(sdist)
    cache = CacheLayout(default_cache_root())
    staged = cache.source_path(sha, sdist.name)
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_bytes(sdist.read_bytes())
    manifest = yaml.safe_load((REPO_ROOT / "kernels_manifest.yaml").read_text())
    manifest["kernels"]["ftimage-testkernel"] = {
        "version": version, "kind": "cuda-extension", "import_name": "ftimage_testkernel_cuda",
        "extension_module": "ftimage_testkernel_cuda",
        "source": {"sdist": {"url": f"https://example.invalid/{sdist.name}", "filename": sdist.name, "sha256": sha}},
        "build_env": {}, "arch_knob": {"env": "TESTKERNEL_CUDA_ARCHS", "format": "{major}{minor}", "separator": ";"},
        # a copy: a shared object would be dumped as a YAML alias, which the loader refuses
        "build_requires": copy.deepcopy(manifest["kernels"]["causal-conv1d"]["build_requires"]),
        "memory_per_job_gb": 2,
        "constraints": {"python": ">=3.9", "cuda": ">=12.0", "archs": ["sm_80", "sm_90", "sm_100"]},
        "entry_points": {"forward": ["scale_fwd"], "backward": ["scale_bwd"]}, "replaces": []}
    (tmp / "kernels_manifest.yaml").write_text(yaml.safe_dump(manifest))
    image = yaml.safe_load((REPO_ROOT / "images" / "kernel-smoke" / "image.yaml").read_text())
    image.update(name="testkernel", kernels=["ftimage-testkernel"])
    image["runtime"]["attn_implementation"] = "sdpa"   # no flash-attn in this image
    (tmp / "images" / "testkernel").mkdir(parents=True)
    (tmp / "images" / "testkernel" / "image.yaml").write_text(yaml.safe_dump(image))
    return tmp


def _key(ws: Path) -> str:
    return load_plan(ws / "images" / "testkernel", ws / "kernels_manifest.yaml").kernels[0].key


def test_requested_arch_missing_from_the_so_fails_and_caches_nothing(kernel_smoke, tmp_path):
    ws = _testkernel_workspace(tmp_path / "ws", version="0.1.1", hardcoded_arch="80")
    key = _key(ws)
    proc = run_build_cli(str(ws / "images" / "testkernel"), "--kernels-only", "--manifest",
                         str(ws / "kernels_manifest.yaml"), timeout=1800)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "arch coverage (SASS)" in proc.stderr and "did not emit sm_90" in proc.stderr
    assert "sm_80" in proc.stderr  # reported as what the wheel really holds
    assert "NOT cached" in proc.stderr
    assert KernelStore(CacheLayout(default_cache_root())).get(key) is None


def _import_check_refuses(ws: Path, symbol: str) -> None:
    """--kernels-only fails at the GPU-free import check, naming `symbol`; nothing is cached."""
    key = _key(ws)
    proc = run_build_cli(str(ws / "images" / "testkernel"), "--kernels-only", "--manifest",
                         str(ws / "kernels_manifest.yaml"), timeout=1800)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the table wraps the detail: the symbol may follow on the next line
    assert "import/ABI" in proc.stderr and "undefined symbol" in proc.stderr and symbol in proc.stderr
    assert "NOT cached" in proc.stderr and "Traceback" not in proc.stderr
    assert KernelStore(CacheLayout(default_cache_root())).get(key) is None


def test_abi_flavour_mismatch_fails_the_import_check_naming_the_symbol(kernel_smoke, tmp_path):
    """A wheel whose C++ ABI differs from torch's (a wrong-flavour prebuilt)."""
    _import_check_refuses(_testkernel_workspace(tmp_path / "ws", version="0.1.2", old_cxx_abi=True), "_ZN3c10")


def test_dangling_instantiation_fails_the_wheel_checks_not_training(kernel_smoke, tmp_path):
    """A specialised build that references an instantiation it did not compile is caught at
    build time, not at training time."""
    _import_check_refuses(_testkernel_workspace(tmp_path / "ws", version="0.1.3", dangling_instantiation=True),
                          "run_mha_bwd_ILi128")


def _compiler_running() -> bool:
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdline = path.read_bytes()
            if b"nvcc" in cmdline or b"cc1plus" in cmdline:
                return True
        except OSError:
            continue   # exited while we looked
    return False


def test_kill_mid_compile_leaves_no_entry_and_next_run_compiles_cleanly(engine, kernel_smoke, tmp_path):
    ws = _testkernel_workspace(tmp_path / "ws", version=f"0.2.{int(time.time())}")
    key = _key(ws)
    store = KernelStore(CacheLayout(default_cache_root()))
    args = [sys.executable, "-m", "build", str(ws / "images" / "testkernel"), "--kernels-only", "--manifest",
            str(ws / "kernels_manifest.yaml")]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 900
    for line in proc.stderr:
        if "compiling ftimage_testkernel" in line:   # the sdist name
            break
        assert time.monotonic() < deadline
    # kill while nvcc or the host compiler runs (the container's processes are visible in /proc)
    while not _compiler_running():
        assert proc.poll() is None and time.monotonic() < deadline, "the compile never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert store.get(key) is None
    assert not (store.root / key).exists(), "a killed build must not leave a visible entry"
    rerun = run_build_cli(str(ws / "images" / "testkernel"), "--kernels-only", "--json", "--manifest",
                          str(ws / "kernels_manifest.yaml"), timeout=1800)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(rerun.stdout)[0]["cache"].startswith("miss (compiled")
    entry = store.get(key)
    assert entry is not None and entry.meta["archs"]["sass"] == ["sm_90"]
    assert not engine.client.containers.list(all=True, filters={"label": f"io.ftimage.kernel-build={key}"})


def test_sdist_sha256_mismatch_is_refused(tmp_path):
    manifest = yaml.safe_load((REPO_ROOT / "kernels_manifest.yaml").read_text())
    manifest["kernels"]["causal-conv1d"]["source"]["sdist"]["sha256"] = "0" * 63 + "1"
    (tmp_path / "kernels_manifest.yaml").write_text(yaml.safe_dump(manifest))
    cache = tmp_path / "cache"
    proc = run_build_cli("images/kernel-smoke", "--kernels-only", "--manifest", str(tmp_path / "kernels_manifest.yaml"),
                         env={"FTIMAGE_CACHE": str(cache)}, timeout=600)
    assert proc.returncode == 1
    assert "causal_conv1d-1.7.0.tar.gz" in proc.stderr and "corrupt or tampered" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((cache / "sources").rglob("*.tar.gz")), "a mismatching download must not be kept"
