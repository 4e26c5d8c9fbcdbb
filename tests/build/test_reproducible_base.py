"""A bootstrapped base is a function of its packages: no host identity, no today, no run-to-run
state; the same root filesystem gives the same tarball, the same diffID and the same image ID."""
from __future__ import annotations

import hashlib
import os
import stat
import tarfile
import time
from pathlib import Path

import pytest

from build.base import rootfs as rootfs_mod
from build.oci.docker_archive import file_sha256, write_archive
from build.oci.image import image_config
from tests.fakes.engine import FakeEngine

RELEASE_DATE = "Sat, 08 Nov 2025 09:13:21 UTC"
RELEASE_EPOCH = 1762593201


def fake_rootfs(root: Path, *, hostname: str, resolver: str, today: int, umask: int) -> Path:
    """What debootstrap leaves, with the parts that differ between two machines and two days."""
    old = os.umask(umask)
    try:
        tree = root / "rootfs"
        for rel, text in {
            "etc/hostname": hostname + "\n",
            "etc/resolv.conf": f"nameserver {resolver}\n",
            "etc/machine-id": hashlib.md5(hostname.encode()).hexdigest() + "\n",
            "etc/shadow": f"root:*:{today}:0:99999:7:::\ndaemon:*:{today}:0:99999:7:::\n",
            "etc/passwd": "root:x:0:0:root:/root:/bin/bash\n",
            "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_Release":
                f"Origin: Debian\nSuite: stable\nDate: {RELEASE_DATE}\n",
            "var/lib/dpkg/status": "Package: libc6\nStatus: install ok installed\n",
            "var/lib/dpkg/status-old": f"from {hostname}\n",
            "var/cache/debconf/config.dat-old": f"{today}\n",
            "var/cache/ldconfig/aux-cache": os.urandom(16).hex(),
            "var/log/dpkg.log": f"{time.time()}\n",
            "usr/bin/tool": "#!/bin/sh\n",
        }.items():
            path = tree / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (tree / "etc/shadow").chmod(0o640)
        (tree / "usr/bin/tool").chmod(0o755)
        old_file = tree / "usr/bin/tool"
        os.utime(old_file, (1_600_000_000, 1_600_000_000))   # from a package: older than the base
        return tree
    finally:
        os.umask(old)


@pytest.mark.unit
def test_host_identity_and_volatile_state_go_and_the_shadow_day_is_the_release_day(tmp_path):
    tree = fake_rootfs(tmp_path, hostname="builder-a", resolver="10.1.2.3", today=20423, umask=0o022)
    epoch = rootfs_mod.base_epoch(tree)
    assert epoch == RELEASE_EPOCH
    rootfs_mod.normalise(tree, epoch)
    for rel in ("etc/hostname", "etc/resolv.conf", "etc/machine-id", "var/cache/ldconfig/aux-cache",
                "var/lib/dpkg/status-old", "var/cache/debconf/config.dat-old", "var/log/dpkg.log"):
        assert not (tree / rel).exists(), rel
    assert not list((tree / "var/lib/apt/lists").iterdir())
    day = RELEASE_EPOCH // 86400
    assert (tree / "etc/shadow").read_text() == f"root:*:{day}:0:99999:7:::\ndaemon:*:{day}:0:99999:7:::\n"
    assert stat.S_IMODE((tree / "etc/shadow").stat().st_mode) == 0o640
    assert (tree / "var/lib/dpkg/status").is_file()


@pytest.mark.unit
def test_source_date_epoch_caps_the_base_time(tmp_path, monkeypatch):
    tree = fake_rootfs(tmp_path, hostname="h", resolver="1.1.1.1", today=1, umask=0o022)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert rootfs_mod.base_epoch(tree) == 1700000000
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1900000000")
    assert rootfs_mod.base_epoch(tree) == RELEASE_EPOCH


@pytest.mark.unit
def test_no_release_date_is_a_named_failure(tmp_path):
    (tmp_path / "var/lib/apt/lists").mkdir(parents=True)
    with pytest.raises(rootfs_mod.BuildFailure) as info:
        rootfs_mod.base_epoch(tmp_path)
    assert "no Release file" in str(info.value)


@pytest.mark.unit
def test_two_machines_two_days_two_umasks_give_one_tarball_and_one_image_id(tmp_path):
    results = []
    for name, (host, resolver, today, umask) in {"a": ("builder-a", "10.0.0.2", 20423, 0o022),
                                                 "b": ("builder-b", "192.168.1.1", 20512, 0o077)}.items():
        work = tmp_path / name
        tree = fake_rootfs(work, hostname=host, resolver=resolver, today=today, umask=umask)
        # the umask must not leak: modes come from the packages (here: set explicitly above)
        for path in tree.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)
            elif path.name not in ("shadow", "tool"):
                path.chmod(0o644)
        epoch = rootfs_mod.base_epoch(tree)
        rootfs_mod.normalise(tree, epoch)
        tarball = work / "rootfs.tar"
        rootfs_mod.write_tarball(tree, tarball, epoch)
        diff_id = file_sha256(tarball)
        config = image_config(diff_id, epoch=epoch, env=["PATH=/usr/bin"], cmd=["/bin/bash"],
                              labels={"io.ftimage.base.name": "t"}, created_by="ftimage bootstrap-base t")
        archive = write_archive(tarball, work / "base.tar", ref="ftimage-base/t:1", config=config, diff_id=diff_id)
        results.append((diff_id, archive.id, file_sha256(archive.path)))
        with tarfile.open(tarball) as tar:
            members = {m.name: m for m in tar.getmembers()}
        assert max(m.mtime for m in members.values()) == epoch     # nothing is newer than the base
        assert members["./usr/bin/tool"].mtime == 1_600_000_000      # older files keep their time
    assert results[0] == results[1]
    engine = FakeEngine()
    assert engine.load_archive(tmp_path / "a" / "base.tar", "ftimage-base/t:1") == results[0][1]
