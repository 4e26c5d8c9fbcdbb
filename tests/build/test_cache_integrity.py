"""Caches that cannot lie: an edited, emptied or truncated pip resolution record is refetched,
never trusted (a torch-less image must not come out tagged as a success); a corrupt cached
kernel wheel is named by --plan and `kernels list`, and left for the next build to replace."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from build.cache import CacheLayout
from build.resolve import load_plan
from build.spec import MANIFEST_PATH, REPO_ROOT
from build.wheelhouse import Wheel
from contracts.events import EventLog

pytestmark = pytest.mark.unit


def _fake_closure(plan, cache: CacheLayout) -> tuple[Wheel, ...]:
    """The pinned torch plus one more wheel, stored in the cache under their real hashes."""
    import hashlib

    wheels = []
    for name, version, filename in (("torch", plan.toolchain.torch_version, plan.torch_wheel.filename),
                                    ("einops", "0.8.2", "einops-0.8.2-py3-none-any.whl")):
        data = f"{name} bytes".encode()
        sha = plan.torch_wheel.sha256 if name == "torch" else hashlib.sha256(data).hexdigest()
        path = cache.wheel_path(sha, filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        wheels.append(Wheel(name=name, version=version, filename=filename, sha256=sha))
    return tuple(wheels)


@pytest.fixture
def resolver(tmp_path, monkeypatch):
    """resolve_closure with pip replaced by a counter (no network); the torch wheel's bytes
    cannot hash to the pinned sha here, so cached-wheel re-hashing is stubbed out too."""
    from build import wheelhouse

    plan = load_plan(REPO_ROOT / "images" / "smoke", MANIFEST_PATH)
    cache = CacheLayout(tmp_path / "cache")
    downloads = []
    monkeypatch.setattr(wheelhouse, "_download", lambda *a, **k: downloads.append(1) or _fake_closure(plan, cache))
    monkeypatch.setattr(wheelhouse, "verify_cached_wheels", lambda wheels, cache: None)

    def resolve():
        return wheelhouse.resolve_closure(("einops==0.8.2",), plan=plan, cache=cache, log=EventLog(quiet=True),
                                          purpose="test")
    return resolve, cache, downloads


def _tamper(record, how: str) -> None:
    data = json.loads(record.read_text())
    if how == "edited":
        data["wheels"][0]["sha256"] = "0" * 64
    elif how == "torch removed, sha recomputed":
        from build.resolve import digest
        data["wheels"] = [w for w in data["wheels"] if w["name"] != "torch"]
        data["sha256"] = digest(data["wheels"])
    if how == "emptied":
        record.write_text("")
    elif how == "truncated":
        record.write_text(record.read_text()[: len(record.read_text()) // 2])
    elif how != "deleted":
        record.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["edited", "emptied", "truncated", "torch removed, sha recomputed"])
def test_a_tampered_resolution_record_is_refetched(resolver, how):
    resolve, cache, downloads = resolver
    first = resolve()
    assert not first.cache_hit and downloads == [1]
    assert resolve().cache_hit and downloads == [1]            # intact: reused, no download
    (record,) = cache.resolutions.glob("*.json")
    _tamper(record, how)
    again = resolve()
    assert not again.cache_hit and downloads == [1, 1]         # refetched, not trusted
    assert any(w.name == "torch" for w in again.wheels)
    assert [asdict(w) for w in again.wheels] == [asdict(w) for w in first.wheels]


def test_a_corrupt_kernel_wheel_is_named_by_plan_and_list_and_not_deleted(tmp_path, run_cli):
    plan = load_plan(REPO_ROOT / "images" / "qwen27b", MANIFEST_PATH)
    conv = next(k for k in plan.kernels if k.name == "causal-conv1d")
    entry = tmp_path / "cache" / "kernels" / conv.key
    entry.mkdir(parents=True)
    wheel = "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    (entry / wheel).write_bytes(b"flipped bits")
    (entry / "meta.json").write_text(json.dumps({"key": conv.key, "wheel": wheel, "sha256": "a" * 64,
                                                 "kernel": "causal-conv1d", "version": "1.7.0"}))
    code, out, err = run_cli(["images/qwen27b", "--plan", "--cache", str(tmp_path / "cache")])
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("causal-conv1d"))
    assert "CORRUPT" in row and wheel in row
    code, out, err = run_cli(["kernels", "list", "--cache", str(tmp_path / "cache")])
    assert code == 0 and f"{conv.key[:16]}  CORRUPT: {wheel} has sha256" in out, out + err
    assert (entry / wheel).exists()          # reported, not silently deleted
    # --plan --json carries the same cache state and compile cost as the table
    code, out, err = run_cli(["images/qwen27b", "--plan", "--json", "--cache", str(tmp_path / "cache")])
    kernels = {k["name"]: k["cache"] for k in json.loads(out)["kernels"]}
    assert kernels["causal-conv1d"]["state"] == "corrupt" and wheel in kernels["causal-conv1d"]["detail"]
    assert kernels["flash-attn"]["state"] == "miss" and "sources" in kernels["flash-attn"]["expected_compile"]
    assert kernels["flash-linear-attention"]["state"] == "n/a"
