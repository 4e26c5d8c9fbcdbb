"""Content-addressed keys: one changed input changes exactly the keys that depend on it."""
from __future__ import annotations

import pytest

from build.resolve import load_plan

pytestmark = pytest.mark.unit
TC = "cu130-torch2.14.1-py311"


def keys(ws, name="qwen27b"):
    plan = load_plan(ws.image(name), ws.manifest)
    return plan, {k.name: k.key for k in plan.kernels}


def test_identical_inputs_give_byte_identical_plans(ws):
    first, _ = keys(ws)
    second, _ = keys(ws)
    assert first.to_json() == second.to_json()
    assert first.plan_key == second.plan_key


def test_torch_sha_changes_every_compiled_kernel_key_only(ws):
    plan, before = keys(ws)
    manifest = ws.load_manifest()
    manifest["toolchains"][TC]["torch"]["wheels"]["linux_x86_64"]["sha256"] = "f" * 64
    ws.save_manifest(manifest)
    plan2, after = keys(ws)
    assert after["flash-attn"] != before["flash-attn"]
    assert after["causal-conv1d"] != before["causal-conv1d"]
    # Triton kernels compile nothing, so their wheel does not depend on torch's bytes.
    assert after["flash-linear-attention"] == before["flash-linear-attention"]
    assert plan2.plan_key != plan.plan_key


def test_one_arch_changes_compiled_keys_and_the_knob(ws):
    _, before = keys(ws)
    image = ws.load("qwen27b")
    image["target_archs"] = ["sm_90"]
    ws.save("qwen27b", image)
    plan, after = keys(ws)
    assert after["flash-attn"] != before["flash-attn"]
    assert after["causal-conv1d"] != before["causal-conv1d"]
    assert after["flash-linear-attention"] == before["flash-linear-attention"]
    knobs = {k.name: k.build_env for k in plan.kernels}
    assert knobs["flash-attn"]["FLASH_ATTN_CUDA_ARCHS"] == "90"
    assert knobs["causal-conv1d"]["CAUSAL_CONV1D_CUDA_ARCHS"] == "90"


def test_kernel_version_changes_only_that_kernel(ws):
    _, before = keys(ws)
    manifest = ws.load_manifest()
    manifest["kernels"]["causal-conv1d"]["version"] = "1.7.1"
    ws.save_manifest(manifest)
    _, after = keys(ws)
    assert after["causal-conv1d"] != before["causal-conv1d"]
    assert after["flash-attn"] == before["flash-attn"]
    assert after["flash-linear-attention"] == before["flash-linear-attention"]


def test_python_deps_change_plan_key_but_no_kernel_key(ws):
    plan, before = keys(ws)
    image = ws.load("qwen27b")
    image["python"]["requirements"].append("accelerate==1.15.0")
    ws.save("qwen27b", image)
    plan2, after = keys(ws)
    assert after == before
    assert plan2.plan_key != plan.plan_key


def test_conditional_patch_applies_only_to_matching_torch(ws):
    plan, _ = keys(ws)
    fa = next(k for k in plan.kernels if k.name == "flash-attn")
    assert [p.path for p in fa.patches] == ["build/patches/flash-attn-2.8.3-cxx20.patch",
                                            "build/patches/flash-attn-2.8.3-specialise.patch"]
    manifest = ws.load_manifest()
    manifest["kernels"]["flash-attn"]["patches"][0]["when_torch"] = ">=2.15"
    ws.save_manifest(manifest)
    plan2, after = keys(ws)
    fa2 = next(k for k in plan2.kernels if k.name == "flash-attn")
    assert [p.path for p in fa2.patches] == ["build/patches/flash-attn-2.8.3-specialise.patch"]
    assert fa2.key != fa.key


def test_arch_knob_format_is_per_package(ws):
    manifest = ws.load_manifest()
    manifest["kernels"]["causal-conv1d"]["arch_knob"] = {"env": "TORCH_CUDA_ARCH_LIST", "format": "{major}.{minor}",
                                                         "separator": " "}
    ws.save_manifest(manifest)
    plan, _ = keys(ws)
    cc = next(k for k in plan.kernels if k.name == "causal-conv1d")
    assert cc.build_env["TORCH_CUDA_ARCH_LIST"] == "9.0 10.0"
