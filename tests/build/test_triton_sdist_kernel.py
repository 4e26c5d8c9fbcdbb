"""A Triton kernel pinned by its sdist (mamba-ssm: PyPI has no wheel of it) is built into a
pure-Python wheel by the compile recipe and cached, like a compiled kernel; its key covers only
its sources, so a cache entry made from other patches or knobs is stale and rebuilt. Its checks
want a wheel without GPU code, and the entry-point check reads sources without importing them."""
from __future__ import annotations

import dataclasses
import sys

import pytest

import build.kernels as kernel_stage
from build.cache import CacheLayout
from build.kernels import incontainer_check
from build.kernels.archs import archs_of_wheel
from build.kernels.compile import built_from_sdist, entry_meta, unkeyed_inputs
from build.kernels.store import KernelStore
from build.kernels.wheel_checks import wheel_content_rows
from build.resolve import digest, load_plan
from build.spec import MANIFEST_PATH, REPO_ROOT, load_manifest
from contracts.events import EventLog
from contracts.lock import Specialisation
from contracts.schema import Problems
from tests.build.kernel_wheels import write_wheel
from tests.fakes.engine import FakeEngine

pytestmark = pytest.mark.unit
QUIET = EventLog(quiet=True)


def mamba_plan(**changes):
    """kernel-smoke's plan with mamba-ssm from the shipped manifest as its one kernel, keyed as
    build/resolve keys a Triton kernel (its sources only)."""
    plan = load_plan(REPO_ROOT / "images" / "kernel-smoke")
    entry = load_manifest(MANIFEST_PATH, Problems()).kernels["mamba-ssm"]
    inputs = {"kernel": "mamba-ssm", "version": entry.version, "kind": entry.kind, "sources": [entry.sdist.sha256]}
    kernel = dataclasses.replace(
        plan.kernels[0], name="mamba-ssm", version=entry.version, kind=entry.kind, import_name=entry.import_name,
        extension_module="", key=digest(inputs), key_inputs=inputs, sources=(entry.sdist,), patches=entry.patches,
        build_env=dict(entry.build_env), build_requires=entry.build_requires, specialisation=Specialisation(),
        estimate=None)
    return dataclasses.replace(plan, kernels=(dataclasses.replace(kernel, **changes),))


def fake_build(calls):
    """compile_kernel as the recipe's pure-Python build ends: a py3-none-any wheel, published with
    the meta.json compile.py writes."""
    def compile_kernel(kernel, plan, *, cache, engine, log, builder_base, store):
        calls.append(kernel.name)
        staging = store.staging(kernel.key)
        wheel = write_wheel(staging, "mamba-ssm", kernel.version, sass=(), tag="py3-none-any",
                            payload=f"build {len(calls)}".encode())
        return store.publish(kernel.key, staging, entry_meta(kernel, wheel, {}, (), (), b"log", 4.0, 1))
    return compile_kernel


def test_only_a_triton_kernel_pinned_by_wheels_is_fetched_as_is():
    kinds = {k.name: built_from_sdist(k) for k in load_plan(REPO_ROOT / "images" / "qwen27b").kernels}
    assert kinds == {"flash-attn": True, "causal-conv1d": True, "flash-linear-attention": False}
    assert built_from_sdist(mamba_plan().kernels[0])


def test_a_triton_kernel_pinned_by_its_sdist_is_built_once_then_hits(tmp_path, monkeypatch):
    plan, cache = mamba_plan(), CacheLayout(tmp_path / "cache")
    calls: list[str] = []
    monkeypatch.setattr(kernel_stage, "compile_kernel", fake_build(calls))
    assert kernel_stage.expected_costs(plan, cache)[plan.kernels[0].key][0] == "miss"
    first = kernel_stage.provide_kernels(plan, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    assert calls == ["mamba-ssm"] and first.states["mamba-ssm"].startswith("miss (built")
    assert [w.filename for w in first.wheels] == ["mamba_ssm-2.3.1-py3-none-any.whl"]   # the wheel, not the sdist
    assert first.entries == {}      # never queued for a registry: it takes compiled kernels only
    second = kernel_stage.provide_kernels(plan, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    assert calls == ["mamba-ssm"] and second.states["mamba-ssm"] == "hit local"
    assert [w.sha256 for w in second.wheels] == [w.sha256 for w in first.wheels]
    assert kernel_stage.expected_costs(plan, cache)[plan.kernels[0].key] == ("hit local", "0s (cached)")


@pytest.mark.parametrize("change", ["patch", "knob", "build requirement"])
def test_an_entry_made_from_other_patches_or_knobs_is_stale_and_rebuilt(tmp_path, monkeypatch, change):
    old = mamba_plan()
    kernel = old.kernels[0]
    new = mamba_plan(**{
        "patch": {"patches": (dataclasses.replace(kernel.patches[0], sha256="e" * 64),)},
        "knob": {"build_env": {**kernel.build_env, "MAMBA_SKIP_CUDA_BUILD": "FALSE"}},
        "build requirement": {"build_requires": ("wheel==0.46.2", "packaging==26.4")},
    }[change])
    assert new.kernels[0].key == kernel.key     # the key covers the sources only
    cache = CacheLayout(tmp_path / "cache")
    calls: list[str] = []
    monkeypatch.setattr(kernel_stage, "compile_kernel", fake_build(calls))
    kernel_stage.provide_kernels(old, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    state, _ = kernel_stage.expected_costs(new, cache)[kernel.key]
    assert state.startswith("STALE") and "mamba_ssm-2.3.1-py3-none-any.whl" in state
    rebuilt = kernel_stage.provide_kernels(new, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    assert calls == ["mamba-ssm", "mamba-ssm"] and rebuilt.states["mamba-ssm"].startswith("miss")
    entry = KernelStore(cache).state(kernel.key, unkeyed_inputs(new.kernels[0])).entry
    assert entry is not None and entry.meta["built_from"] == unkeyed_inputs(new.kernels[0])


def test_a_compiled_kernel_records_nothing_beyond_its_key():
    conv = next(k for k in load_plan(REPO_ROOT / "images" / "kernel-smoke").kernels if k.name == "causal-conv1d")
    assert unkeyed_inputs(conv) is None      # its key holds patches, knobs and build requirements


def test_a_triton_wheel_must_hold_no_gpu_code_and_be_pure(tmp_path):
    kernel = mamba_plan().kernels[0]
    pure = write_wheel(tmp_path / "a", "mamba-ssm", "2.3.1", sass=(), tag="py3-none-any")
    rows = wheel_content_rows(kernel, pure.name, archs_of_wheel(pure), python="3.11", platform=None)
    assert {r.check: r.status for r in rows} == {"pure Python (no GPU code)": "PASS", "wheel tag: pure": "PASS"}
    compiled = write_wheel(tmp_path / "b", "mamba-ssm", "2.3.1", sass=("sm_90",))   # the extension got built
    rows = wheel_content_rows(kernel, compiled.name, archs_of_wheel(compiled), python="3.11", platform=None)
    assert [r.status for r in rows] == ["FAIL", "FAIL"] and "sm_90" in rows[0].detail
    assert "build_env" in rows[0].fix


def test_entry_points_are_found_without_importing_the_package(tmp_path, monkeypatch):
    """Importing mamba_ssm needs transformers and einops (absent from a builder) and fla's import
    starts Triton's GPU driver: the check reads the source files instead."""
    package = tmp_path / "pkg_that_cannot_import"
    (package / "ops" / "triton").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing me is a bug')\n")
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "triton" / "__init__.py").write_text("")
    (package / "ops" / "triton" / "combined.py").write_text(
        "class Fn:\n    def forward(ctx):\n        pass\n\n    def backward(ctx):\n        pass\n\n"
        "def update(state):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    target = "pkg_that_cannot_import.ops.triton.combined"
    kernel = {"name": "k", "entry_points": {"forward": [f"{target}:Fn.forward"], "backward": [f"{target}:Fn.backward"],
                                            "other": [f"{target}:update", f"{target}:gone",
                                                      "pkg_that_cannot_import.ops.nowhere:update"]}}
    rows: list[dict] = []
    incontainer_check.check_python_entry_points(kernel, rows)
    assert [(r["check"], r["status"]) for r in rows] == [
        ("entry point (forward)", "PASS"), ("entry point (backward)", "PASS"), ("entry point (other)", "PASS"),
        ("entry point (other)", "FAIL"), ("entry point (other)", "FAIL")]
    assert rows[-1]["detail"].endswith("module not found")
    assert "pkg_that_cannot_import" not in sys.modules
