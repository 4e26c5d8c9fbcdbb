"""Two real bootstraps of the runtime base, under different umasks and time zones, give the same
root filesystem tarball, and it is the one this test run's smoke build loaded (its diffID label)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from build.bootstrap import ROOTFS_LABEL, base_tag, rootfs_tarball
from build.image_archive import file_sha256
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
