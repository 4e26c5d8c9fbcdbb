"""Which user the checks run as: real root, root inside a rootless user namespace, or not root.

The image runs as a non-root user, and every runtime the project is tested under keeps it so.
But Slurm's OCI path and pyxis run no ENTRYPOINT and take the user from their own config, so an
`oci.conf` or a bundle can start the command as real root. That is not a training failure (the
fused paths are the same) but a hardening one, so it is a WARN naming the uid and the fix, in
every verify run: the one `python -I -m entrypoint` runs before training and the one the gate runs.
Uid 0 inside a user namespace that maps it to an unprivileged host uid (`umoci unpack --rootless`,
Slurm's rootless OCI containers, rootless podman) is not root on the host: it is named as such.
"""
from __future__ import annotations

import os
from pathlib import Path

from verify.report import CheckResult, Status

UID_MAP = Path("/proc/self/uid_map")
FIX = ("run the image as its own non-root user: drop `--user 0` (docker, podman), keep pyxis's "
       "--no-container-remap-root, or give the OCI bundle a non-root uid or a rootless user namespace "
       "(umoci unpack --rootless)")


def host_uid_of_root(uid_map: str) -> int | None:
    """The host uid that uid 0 of this namespace maps to, from /proc/self/uid_map (None: unmapped)."""
    for line in uid_map.splitlines():
        parts = line.split()
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            inside, outside, count = map(int, parts)
            if inside <= 0 < inside + count:
                return outside + (0 - inside)
    return None


def decide_user(uid: int, gid: int, uid_map: str | None) -> CheckResult:
    """Pure: the row for this process's uid and its user namespace map (None: unreadable)."""
    data = {"uid": uid, "gid": gid, "uid_map": uid_map}
    if uid != 0:
        return CheckResult("environment.user", Status.PASS, f"runs as uid {uid}, gid {gid} (not root)", data=data)
    host = host_uid_of_root(uid_map) if uid_map is not None else None
    if host not in (None, 0):
        return CheckResult("environment.user", Status.PASS, f"uid 0 inside a rootless user namespace: host uid "
                           f"{host} (as Slurm's OCI containers and umoci --rootless run it); not root on the host",
                           data={**data, "host_uid": host})
    where = "no user namespace maps it" if host == 0 else "its user namespace map is unreadable"
    return CheckResult("environment.user", Status.WARN, f"runs as real root: uid 0, gid {gid}, and {where}; the "
                       "image is built to run as a non-root user", FIX, data={**data, "host_uid": host})


def user_row() -> CheckResult:
    try:
        uid_map = UID_MAP.read_text()
    except OSError:
        uid_map = None
    return decide_user(os.getuid(), os.getgid(), uid_map)
