"""The lock names every installed kernel wheel by the distribution it installs."""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from build.context import make_lock
from build.kernels.wheel import KernelWheel
from build.resolve import load_plan
from build.spec import REPO_ROOT
from contracts.lock import BuildLock

pytestmark = pytest.mark.unit


def _fla_wheels(plan) -> tuple[KernelWheel, ...]:
    fla = next(k for k in plan.kernels if k.name == "flash-linear-attention")
    return tuple(KernelWheel(name=fla.name, key=fla.key, filename=s.filename, sha256=s.sha256, path=Path("/x"))
                 for s in fla.sources)


def test_each_fla_wheel_is_locked_under_its_own_distribution():
    """Regression: both fla wheels were locked as `flash-linear-attention`, so verify hashed that
    distribution twice and never checked fla-core, which holds the Triton kernels."""
    plan = load_plan(REPO_ROOT / "images" / "qwen27b")
    lock = make_lock(plan, (), _fla_wheels(plan), {})
    by_wheel = {k.wheel: k for k in lock.kernels}
    assert by_wheel["fla_core-0.6.0-py3-none-any.whl"].distribution == "fla-core"
    assert by_wheel["flash_linear_attention-0.6.0-py3-none-any.whl"].distribution == "flash-linear-attention"
    assert {k.name for k in lock.kernels} == {"flash-linear-attention"}   # one kernel, two wheels
    assert BuildLock.from_dict(__import__("json").loads(lock.to_json())).kernels == lock.kernels


def test_verify_hashes_fla_core_files_against_its_own_record(tmp_path, monkeypatch):
    """The environment check looks up the lock entry's distribution: a tampered fla-core file is
    found, which it could not be while both entries named flash-linear-attention."""
    from verify.checks import environment as env

    site = tmp_path / "site"
    (site / "fla").mkdir(parents=True)
    kernel_file = site / "fla" / "chunk.py"
    kernel_file.write_text("# triton kernels\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(kernel_file.read_bytes()).digest()).rstrip(b"=").decode()
    info = site / "fla_core-0.6.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fla-core\nVersion: 0.6.0\n")
    (info / "RECORD").write_text(f"fla/chunk.py,sha256={digest},{kernel_file.stat().st_size}\n")
    monkeypatch.syspath_prepend(str(site))
    plan = load_plan(REPO_ROOT / "images" / "qwen27b")
    core = next(k for k in make_lock(plan, (), _fla_wheels(plan), {}).kernels if k.distribution == "fla-core")
    (row,) = env.check_installed([core], deep=False)
    assert row.check == "environment.kernel.fla-core" and row.status.name == "PASS", row.detail
    kernel_file.write_text("# tampered\n")
    (row,) = env.check_installed([core], deep=False)
    assert row.status.name == "FAIL" and "fla/chunk.py" in row.detail
