"""Bootstrap a Debian base image locally, for hosts with no registry: debootstrap (from the
base's deb lock), a deterministic root filesystem tarball (rootfs.py), and a config this tool
writes, loaded into the engine as a docker-archive (build/oci/docker_archive.py). No `docker
import`, which would stamp the image with the time of the import: the same root filesystem
gives the same image ID on every machine.

Idempotent: the image is tagged by the hash of its spec and labelled with it, and an
existing image with the same spec hash is reused as is. `ensure_base` also accepts a registry
base the engine already holds (builds never pull).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from build import proc
from build.base import debs_lock
from build.base.rootfs import base_epoch, normalise, write_tarball
from build.cache import CacheLayout, default_cache_root
from build.engine import Engine
from build.errors import BuildFailure
from build.oci.docker_archive import file_sha256, write_archive
from build.oci.image import image_config
from build.resolve import digest
from build.spec import BaseRef, BootstrapBase
from contracts.events import EventLog, Progress

SPEC_LABEL = "io.ftimage.base.spec-sha256"
ROOTFS_LABEL = "io.ftimage.base.rootfs"   # the layer's diffID: the same root filesystem on every machine
BASE_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class BaseImage:
    ref: str          # what FROM uses
    id: str           # image ID (sha256:...), recorded in the lock
    reused: bool


def base_tag(base: BootstrapBase) -> str:
    return f"ftimage-base/{base.name}:{digest(base.spec_dict())[:12]}"


def ensure_base(ref: BaseRef, engine: Engine, cache: CacheLayout, log: EventLog) -> BaseImage:
    """Return a usable base for a stage: a bootstrapped one (built if needed) or a registry one."""
    if ref.bootstrap:
        return bootstrap(ref.bootstrap, engine, cache, log)
    wanted = f"{ref.image}@{ref.digest}" if ref.digest else ref.image
    info = engine.image(wanted) or engine.image(ref.image)
    if info is None:
        raise BuildFailure(f"base image {wanted} is not in the local engine and builds never pull",
                           f"`docker pull {wanted}` on a host with registry access, or `docker load` it here")
    if ref.digest and not any(d.endswith(ref.digest) for d in info.get("RepoDigests", [])):
        raise BuildFailure(f"local image {ref.image} does not have the pinned digest {ref.digest}",
                           f"pull the pinned image: `docker pull {ref.image}@{ref.digest}`")
    return BaseImage(ref=wanted, id=info["Id"], reused=True)


def bootstrap(base: BootstrapBase, engine: Engine, cache: CacheLayout, log: EventLog) -> BaseImage:
    """The base's image, bootstrapped unless the engine holds it. Two builds on one host that need
    the same base at once bootstrap it once: the second waits on a lock and then reuses it."""
    spec_sha = digest(base.spec_dict())
    cache.root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache.root / f".base-{spec_sha[:16]}.lock")):
        return _bootstrap_unlocked(base, spec_sha, engine, cache, log)


def _bootstrap_unlocked(base: BootstrapBase, spec_sha: str, engine: Engine, cache: CacheLayout,
                        log: EventLog) -> BaseImage:
    tag = base_tag(base)
    existing = engine.image(tag)
    if existing and (existing.get("Config", {}).get("Labels") or {}).get(SPEC_LABEL) == spec_sha:
        log.emit("bootstrap", f"reusing base {tag}", id=existing["Id"][:19])
        return BaseImage(ref=tag, id=existing["Id"], reused=True)
    if shutil.which("debootstrap") is None:
        raise BuildFailure("debootstrap is not installed, so the base cannot be bootstrapped",
                           "`apt-get install -y debootstrap`, or name a registry base in image.yaml")
    if os.geteuid() != 0:
        raise BuildFailure("debootstrap needs root to build a base filesystem",
                           f"run `sudo python -m build bootstrap-base {base.path}` once; later builds reuse it")
    with cache.scratch_dir("base") as tmp:
        tarball, epoch = rootfs_tarball(base, Path(tmp), log, cache)
        diff_id = file_sha256(tarball)
        log.emit("bootstrap", "loading the root filesystem", size_mb=tarball.stat().st_size // 2 ** 20,
                 diff_id=diff_id[:19])
        config = image_config(diff_id, epoch=epoch, env=[BASE_PATH, "LANG=C.UTF-8"], cmd=["/bin/bash"],
                              labels={SPEC_LABEL: spec_sha, "io.ftimage.base.name": base.name,
                                      ROOTFS_LABEL: diff_id},
                              created_by=f"ftimage bootstrap-base {base.name}")
        archive = write_archive(tarball, Path(tmp) / "base.tar", ref=tag, config=config, diff_id=diff_id)
        tarball.unlink()
        image_id = engine.load_archive(archive.path, tag)
        if image_id != archive.id:
            raise BuildFailure(f"the engine gave the loaded base the ID {image_id[:19]}, not its config's "
                               f"{archive.id[:19]}", "check the dockerd log: the engine must keep the config as given")
    log.emit("bootstrap", f"base ready: {tag}", id=image_id[:19])
    return BaseImage(ref=tag, id=image_id, reused=False)


def rootfs_tarball(base: BootstrapBase, work: Path, log: EventLog,
                   cache: CacheLayout | None = None) -> tuple[Path, int]:
    """debootstrap into `work`, make the tree deterministic (rootfs.py) and tar it; returns
    (the tarball, the base's epoch). With a deb lock, only the locked .debs are installed, from a
    local repository made of them (debs_lock.py)."""
    rootfs = work / "rootfs"
    progress = Progress(log, "bootstrap", base.name, expected_seconds=90.0, min_interval=5.0)
    progress.update(None, f"debootstrap {base.suite} ({base.variant}) with {', '.join(base.packages)}", force=True)
    lock = debs_lock.load_lock(base.path)
    mirror, extra = base.mirror, []
    if lock is not None:
        debs = debs_lock.ensure_debs(lock, cache or CacheLayout(default_cache_root()), log)
        mirror = debs_lock.write_repository(lock, debs, work / "repo")
        extra = ["--no-check-gpg"]   # the repository holds only .debs checked against the reviewed lock
        progress.update(None, f"installing the {len(debs)} locked packages of {debs_lock.LOCK_NAME}", force=True)
    cmd = ["debootstrap", f"--variant={base.variant}", f"--include={','.join(sorted(base.packages))}", *extra,
           base.suite, str(rootfs), mirror]
    # debootstrap creates folders itself (the root among them) with the caller's umask; under
    # umask 077 the image's / would be 0700. dpkg sets package modes explicitly.
    inherited = os.umask(0o022)
    try:
        child = proc.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        os.umask(inherited)
    output = []
    for line in child.stdout:
        output.append(line)
        if line.startswith(("I: Retrieving", "I: Validating", "I: Unpacking", "I: Configuring", "I: Base")):
            progress.update(None, line[3:].strip()[:100])
    if child.wait() != 0:
        tail = "\n".join("".join(output).splitlines()[-15:])
        raise BuildFailure(f"debootstrap failed for base {base.name}:\n{tail}",
                           f"check that {base.mirror} is reachable and the package names exist in {base.suite}")
    epoch = base_epoch(rootfs)
    if lock is not None:   # the image names the real mirror, not this build's scratch folder
        (rootfs / "etc/apt/sources.list").write_text(f"deb {lock.mirror} {lock.suite} main\n")
    normalise(rootfs, epoch)
    tarball = work / "rootfs.tar"
    write_tarball(rootfs, tarball, epoch)
    shutil.rmtree(rootfs)
    progress.finish("root filesystem ready")
    return tarball, epoch
