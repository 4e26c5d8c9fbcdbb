"""Make a bootstrapped root filesystem a function of its packages, not of the machine or the day.

debootstrap copies the build host's /etc/hostname and /etc/resolv.conf (which leaks the build
network's resolver into every image), stamps /etc/shadow with today's day number, and leaves
caches and logs that differ from run to run. Here:
  * host identity goes: hostname, resolv.conf and machine-id are removed (the engine provides
    them to each container);
  * volatile state goes: apt lists and archives, logs, ldconfig's aux-cache, dpkg's and
    debconf's `-old` backups, man pages;
  * the base's time is the Date of the Debian Release file it was bootstrapped from (a property
    of the mirror's state, the same for every machine that bootstraps from it), capped by
    SOURCE_DATE_EPOCH: /etc/shadow's last-change day is that day, and no file is newer;
  * the tarball is written with sorted entries, numeric owners, no atime/ctime, and extended
    attributes (file capabilities) dropped.
"""
from __future__ import annotations

import email.utils
import os
import shutil
import subprocess
from pathlib import Path

from build import proc
from build.errors import BuildFailure
from build.source_date import parse_epoch

REMOVED = ("etc/hostname", "etc/resolv.conf", "etc/machine-id", "var/lib/dbus/machine-id",
           "var/cache/ldconfig/aux-cache")
EMPTIED = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/man", "usr/share/info", "var/log")
BACKUPS = ("var/cache/debconf", "var/lib/dpkg")   # their `*-old` files are the previous state


def release_epoch(rootfs: Path) -> int:
    """The Date of the suite's Release file that debootstrap fetched (before the lists go)."""
    for name in sorted(os.listdir(rootfs / "var/lib/apt/lists")) if (rootfs / "var/lib/apt/lists").is_dir() else []:
        if name.endswith(("_Release", "_InRelease")):
            for line in (rootfs / "var/lib/apt/lists" / name).read_text(errors="replace").splitlines():
                if line.startswith("Date:"):
                    parsed = email.utils.parsedate_to_datetime(line[5:].strip())
                    return int(parsed.timestamp())
    raise BuildFailure("debootstrap left no Release file with a Date in var/lib/apt/lists",
                       "bootstrap from a Debian mirror that serves signed Release files")


def base_epoch(rootfs: Path) -> int:
    epoch = release_epoch(rootfs)
    env = os.environ.get("SOURCE_DATE_EPOCH")
    if env is not None:
        epoch = min(epoch, parse_epoch(env))
    return epoch


def normalise(rootfs: Path, epoch: int) -> None:
    rootfs.chmod(0o755)   # the image's /, whatever umask created the folder
    for rel in REMOVED:
        target = rootfs / rel
        if target.is_symlink() or target.is_file():
            target.unlink()
    for rel in EMPTIED:
        target = rootfs / rel
        if target.is_dir() and not target.is_symlink():
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                elif child.name != "lock":
                    child.unlink()
    for rel in BACKUPS:
        for old in sorted((rootfs / rel).glob("*-old")) if (rootfs / rel).is_dir() else []:
            if old.is_file() and not old.is_symlink():
                old.unlink()
    _shadow_day(rootfs / "etc/shadow", epoch // 86400)
    _shadow_day(rootfs / "etc/shadow-", epoch // 86400)


def _shadow_day(path: Path, day: int) -> None:
    """Field 3 of /etc/shadow is the day of the last password change: the base's day, not today's."""
    if not path.is_file() or path.is_symlink():
        return
    lines = []
    for line in path.read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[2]:
            fields[2] = str(day)
        lines.append(":".join(fields))
    mode = path.stat().st_mode
    path.write_text("\n".join(lines) + "\n")
    path.chmod(mode)


def write_tarball(rootfs: Path, tarball: Path, epoch: int) -> None:
    try:
        proc.run(["tar", "--sort=name", "--numeric-owner", "--no-xattrs", "--no-acls", "--no-selinux",
                  f"--mtime=@{epoch}", "--clamp-mtime", "--format=posix",
                  "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
                  "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    except subprocess.CalledProcessError as exc:
        raise BuildFailure(f"tar of the root filesystem failed: {exc}", "check free space under the cache") from None
