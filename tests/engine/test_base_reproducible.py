"""Two real bootstraps of the runtime base, under different umasks and time zones, give the same
root filesystem tarball, and it is the one this test run's smoke build loaded (its diffID label)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from build.base.bootstrap import ROOTFS_LABEL, base_tag, rootfs_tarball
from build.oci.docker_archive import file_sha256
from build.resolve import load_plan
from build.spec import REPO_ROOT
from contracts.events import EventLog

pytestmark = pytest.mark.engine


def _bootstrap(base, work: Path, umask: int, tz: str) -> str:
    old_umask, old_tz = os.umask(umask), os.environ.get("TZ")
    os.environ["TZ"] = tz
    try:
        tarball, _ = rootfs_tarball(base, work, EventLog(quiet=True))
        return file_sha256(tarball)
    finally:
        os.umask(old_umask)
        if old_tz is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old_tz


def test_two_bootstraps_give_the_same_rootfs_as_the_loaded_base(engine, smoke_build, tmp_path):
    base = load_plan(REPO_ROOT / "images" / "smoke").spec.runtime_base.bootstrap
    first = _bootstrap(base, tmp_path / "a", 0o022, "UTC")
    second = _bootstrap(base, tmp_path / "b", 0o077, "Pacific/Kiritimati")
    assert first == second, "two bootstraps from one mirror state differ (did the mirror publish in between?)"
    loaded = engine.image(base_tag(base))
    assert loaded["Config"]["Labels"][ROOTFS_LABEL] == first
    assert loaded["RootFS"]["Layers"] == [first]


def test_bases_update_pins_from_the_signed_index_and_replaces_a_damaged_lock(tmp_path):
    """`bases update` as a user runs it, on a copy of the runtime base whose lock was damaged:
    it verifies the mirror's InRelease, pins every package debootstrap resolves, and says what changed."""
    import json
    import shutil

    from build.base import debs_lock
    from tests.conftest import run_build_cli

    folder = tmp_path / "debian-bookworm"
    folder.mkdir()
    shutil.copy(REPO_ROOT / "images/_bases/debian-bookworm/base.yaml", folder / "base.yaml")
    (folder / debs_lock.LOCK_NAME).write_text("{not json")
    proc = run_build_cli("bases", "update", str(folder), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "review and commit it" in proc.stdout and "(new)" in proc.stdout
    lock = debs_lock.load_lock(folder)       # loads: every field passed the lock's own checks
    names = {d.package for d in lock.debs}
    assert {"python3", "python3-venv", "ca-certificates", "libc6", "dpkg", "zlib1g"} <= names
    assert len(json.loads(lock.to_json())["debs"]) == len(names) > 50   # the mirror may move; the shape may not
