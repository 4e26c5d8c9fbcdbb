import base64
import hashlib
import importlib.metadata
import os
from dataclasses import replace
from pathlib import Path

import pytest

from contracts.lock import LockedKernel, LockedPackage
from verify.checks import environment as env
from verify.context import Context
from verify.report import Status

pytestmark = pytest.mark.unit


def test_no_cuda_device_fails_with_a_fix():
    row = env.decide_cuda_device(False, 0)
    assert row.status is Status.FAIL and row.detail == "no CUDA device"
    assert "--gpus all" in row.fix


def test_arch_must_be_in_the_lock():
    assert env.decide_arch((9, 0), ("sm_90",)).status is Status.PASS
    row = env.decide_arch((10, 3), ("sm_90", "sm_100"))
    assert row.status is Status.FAIL and "sm_103" in row.detail and "sm_103" in row.fix


@pytest.mark.parametrize("driver, lock_cuda, status", [
    (13000, "13.0", Status.PASS), (13020, "13.0", Status.PASS), (12080, "13.0", Status.FAIL),
    (None, "13.0", Status.FAIL), (13000, "cpu", Status.FAIL),
])
def test_driver_must_support_the_lock_cuda(driver, lock_cuda, status):
    assert env.decide_driver(driver, lock_cuda).status is status


def test_versions_compare_against_the_lock(env_lock):
    lock = replace(env_lock, torch="2.99.0", cuda="cpu")
    rows = {r.check: r for r in env.decide_versions(lock, "3.11.7", "2.13.0+cpu", None, lock.transformers)}
    assert rows["environment.torch"].status is Status.FAIL and "2.99.0" in rows["environment.torch"].detail
    assert rows["environment.torch_cuda"].status is Status.PASS
    assert rows["environment.transformers"].status is Status.PASS
    assert rows["environment.python"].status is (Status.PASS if lock.python == "3.11" else Status.FAIL)


def _fake_dist(tmp_path: Path, content: bytes = b"print('hi')\n"):
    """A real on-disk distribution with a RECORD, as pip leaves it."""
    (tmp_path / "fakepkg").mkdir()
    (tmp_path / "fakepkg" / "__init__.py").write_bytes(content)
    info = tmp_path / "fakepkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"fakepkg/__init__.py,sha256={digest},{len(content)}\n"
                                 "fakepkg-1.0.dist-info/RECORD,,\n")
    return importlib.metadata.PathDistribution(info)


def test_record_hashes_catch_a_modified_file(tmp_path):
    dist = _fake_dist(tmp_path)
    assert env._record_mismatches(dist, deep=True) == (1, 0, [])
    (tmp_path / "fakepkg" / "__init__.py").write_text("print('patched')\n")
    hashed, _, bad = env._record_mismatches(dist, deep=True)
    assert bad == ["fakepkg/__init__.py"]
    row = env.decide_installed("package", "fakepkg", "1.0", "1.0", hashed, 0, bad)
    assert row.status is Status.FAIL and "differ from the wheel's RECORD" in row.detail


def test_installed_package_matches_lock_by_version_and_record():
    have = importlib.metadata.version("pytest")
    rows = env.check_installed([LockedPackage(name="pytest", version=have, filename="", sha256="")], deep=False)
    assert rows[0].status is Status.PASS and "match RECORD" in rows[0].detail
    rows = env.check_installed([LockedPackage(name="pytest", version="0.0.1", filename="", sha256="")], deep=False)
    assert rows[0].status is Status.FAIL and "the lock says 0.0.1" in rows[0].detail


def test_locked_kernel_that_is_not_installed_fails():
    kernel = LockedKernel(name="causal-conv1d", distribution="causal-conv1d", version="1.7.0", kind="cuda-extension",
                          import_name="causal_conv1d",
                          key="k", wheel="causal_conv1d-1.7.0.whl", sha256="a" * 64)
    row = env.check_installed([kernel], deep=False)[0]
    assert row.status is Status.FAIL and "not installed" in row.detail
    no_sha = replace(kernel, sha256="")
    assert "no wheel sha256" in env.check_installed([no_sha], deep=False)[0].detail


def test_triton_runtime_needs(tmp_path):
    assert env.decide_triton_runtime(False, None, tmp_path / "Python.h", tmp_path, False).status is Status.SKIP
    (tmp_path / "Python.h").write_text("")
    ok = env.decide_triton_runtime(True, "/usr/bin/gcc", tmp_path / "Python.h", tmp_path, True)
    assert ok.status is Status.PASS
    bad = env.decide_triton_runtime(True, None, tmp_path / "missing.h", tmp_path, False)
    assert bad.status is Status.FAIL
    assert "no C compiler" in bad.detail and "missing.h" in bad.detail and "not writable" in bad.detail


def test_a_triton_cache_on_a_noexec_mount_fails_with_the_fix(tmp_path, monkeypatch):
    """docker's and podman's `--tmpfs /tmp` is noexec unless told: the cache is writable, and the
    launcher Triton compiles into it cannot be loaded."""
    (tmp_path / "Python.h").write_text("")
    row = env.decide_triton_runtime(True, "/usr/bin/gcc", tmp_path / "Python.h", tmp_path, True, cache_exec=False)
    assert row.status is Status.FAIL and f"{tmp_path} is on a noexec mount" in row.detail
    assert "--tmpfs /tmp:exec" in row.fix
    assert env._exec_mount(tmp_path / "not" / "yet" / "made")            # its nearest existing parent is asked
    real = os.statvfs

    class Noexec:
        f_flag = os.ST_NOEXEC

    monkeypatch.setattr(env.os, "statvfs", lambda path: Noexec() if str(path) == str(tmp_path) else real(path))
    assert not env._exec_mount(tmp_path)


def test_cache_dir_writability_is_measured(tmp_path):
    assert env._writable(tmp_path / "cache")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert not env._writable(blocker / "cache")


def test_environment_check_on_this_cpu_machine(env_lock):
    from families import load_family

    ctx = Context(lock=env_lock, device="cpu", family=load_family("qwen3_5_text"))
    rows = {r.check: r for r in env.run(ctx)}
    assert rows["environment.cuda_device"].status is Status.FAIL
    assert rows["environment.cuda_device"].detail == "no CUDA device"
    assert rows["environment.arch"].status is Status.FAIL
    assert rows["environment.torch"].status is Status.PASS
    assert rows["environment.packages"].status is Status.PASS
    assert "transformers" in rows["environment.packages"].data["packages"]


def test_package_rows_are_summarized_but_mismatches_stay_visible():
    ok = env.decide_installed("package", "a", "1", "1", 3, 1, [])
    bad = env.decide_installed("package", "b", "2", "1", 0, 0, [])
    rows = env.summarize_packages([ok, bad])
    assert [r.check for r in rows] == ["environment.package.b", "environment.packages"]
    assert rows[0].status is Status.FAIL
    assert "1 locked package(s)" in rows[1].detail and "1 over 16 MiB" in rows[1].detail


def test_a_kernels_runtime_constraint_fails_on_its_arch_only():
    """fla refuses its gated backward on Hopper with Triton < 3.7.1 (seen on an H200 with triton
    3.6.0): verify says so up front instead of a crash in the middle of a step."""
    from contracts.lock import RuntimeConstraint

    kernel = LockedKernel(name="flash-linear-attention", distribution="fla-core", version="0.6.0", kind="triton",
                          import_name="fla", key="k", wheel="fla_core-0.6.0-py3-none-any.whl", sha256="a" * 64,
                          runtime_constraints=(RuntimeConstraint(package="triton", version=">=3.7.1",
                                                                 archs=("sm_90",), reason="fla #640"),))
    (row,) = env.decide_runtime_constraints([kernel], "sm_90", {"triton": "3.6.0"})
    assert row.status is Status.FAIL and "triton 3.6.0 is installed" in row.detail and "fla #640" in row.detail
    assert env.decide_runtime_constraints([kernel], "sm_100", {"triton": "3.6.0"}) == []
    (ok,) = env.decide_runtime_constraints([kernel], "sm_90", {"triton": "3.8.0"})
    assert ok.status is Status.PASS
    (missing,) = env.decide_runtime_constraints([kernel], "sm_90", {"triton": None})
    assert missing.status is Status.FAIL and "not installed" in missing.detail


@pytest.mark.parametrize("lock_torch, installed, status", [
    ("2.14.1", "2.14.1", Status.PASS),               # PyTorch's cu130 wheel: metadata 2.14.1
    ("2.14.1", "2.14.1+cpu", Status.FAIL),           # a CPU torch never passes for a CUDA lock
    ("2.14.1+cu130", "2.14.1", Status.FAIL),
    ("2.13.0+cpu", "2.13.0+cpu", Status.PASS),
])
def test_torch_is_compared_with_the_lock_by_its_metadata_version(env_lock, lock_torch, installed, status):
    lock = replace(env_lock, torch=lock_torch)
    rows = {r.check: r for r in env.decide_versions(lock, "3.11.7", installed, None, lock.transformers)}
    assert rows["environment.torch"].status is status


def test_an_image_without_transformers_skips_that_row_with_the_reason(env_lock):
    rows = {r.check: r for r in env.decide_versions(replace(env_lock, transformers=""), "3.11.7", env_lock.torch,
                                                    None, None)}
    assert rows["environment.transformers"].status is Status.SKIP
    assert "ships no transformers" in rows["environment.transformers"].detail
    missing = {r.check: r for r in env.decide_versions(env_lock, "3.11.7", env_lock.torch, None, None)}
    assert missing["environment.transformers"].status is Status.FAIL
    assert "not installed" in missing["environment.transformers"].detail


def test_files_dropped_with_their_record_rows_leave_a_consistent_installation(tmp_path):
    """The image drops static archives at build time; their RECORD rows must go with them, or
    verify reports them missing and the image fails its own check."""
    from build.context.drop_installed_files import drop

    dist = _fake_dist(tmp_path)
    archive = tmp_path / "fakepkg" / "libfake.a"
    archive.write_bytes(b"!<arch>\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(archive.read_bytes()).digest()).rstrip(b"=").decode()
    record = tmp_path / "fakepkg-1.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + f"fakepkg/libfake.a,sha256={digest},8\n")

    archive.unlink()   # what `find -name '*.a' -delete` did: the row stays
    _hashed, _skipped, bad = env._record_mismatches(dist, deep=True)
    assert bad == ["fakepkg/libfake.a (missing)"]

    archive.write_bytes(b"!<arch>\n")
    assert drop(tmp_path, ["*.a"]) == ["fakepkg/libfake.a"]
    assert not archive.exists()
    hashed, _skipped, bad = env._record_mismatches(importlib.metadata.PathDistribution(dist._path), deep=True)
    assert bad == [] and hashed == 1
    assert "libfake.a" not in record.read_text()


def test_drop_refuses_a_record_row_outside_site_packages(tmp_path):
    from build.context.drop_installed_files import drop

    (tmp_path / "site").mkdir()
    _fake_dist(tmp_path / "site")
    outside = tmp_path / "victim.a"
    outside.write_bytes(b"keep me")
    record = tmp_path / "site" / "fakepkg-1.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "../victim.a,,\n")
    with pytest.raises(SystemExit, match="outside"):
        drop(tmp_path / "site", ["*.a"])
    assert outside.read_bytes() == b"keep me"
