"""Bootstrap a Debian base image locally (debootstrap + docker import), for hosts with no registry.

Idempotent: the image is tagged by the hash of its spec and labelled with it, and an
existing image with the same spec hash is reused as is.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from build import proc
from build.cache import CacheLayout
from build.engine import Engine
from build.errors import BuildFailure
from build.resolve import digest
from build.spec import BaseRef, BootstrapBase
from contracts.events import EventLog, Progress

SPEC_LABEL = "io.ftimage.base.spec-sha256"


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
    tag = base_tag(base)
    spec_sha = digest(base.spec_dict())
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
        rootfs = Path(tmp) / "rootfs"
        progress = Progress(log, "bootstrap", base.name, expected_seconds=90.0, min_interval=5.0)
        progress.update(None, f"debootstrap {base.suite} ({base.variant}) with {', '.join(base.packages)}",
                        force=True)
        cmd = ["debootstrap", f"--variant={base.variant}", f"--include={','.join(sorted(base.packages))}",
               base.suite, str(rootfs), base.mirror]
        child = proc.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = []
        for line in child.stdout:
            output.append(line)
            if line.startswith(("I: Retrieving", "I: Validating", "I: Unpacking", "I: Configuring", "I: Base")):
                progress.update(None, line[3:].strip()[:100])
        if child.wait() != 0:
            tail = "\n".join("".join(output).splitlines()[-15:])
            raise BuildFailure(f"debootstrap failed for base {base.name}:\n{tail}",
                               f"check that {base.mirror} is reachable and the package names exist in {base.suite}")
        _trim_rootfs(rootfs)
        tarball = Path(tmp) / "rootfs.tar"
        proc.run(["tar", "--sort=name", "--numeric-owner", "-C", str(rootfs), "-cf", str(tarball), "."],
                 check=True)
        progress.finish("root filesystem ready")
        log.emit("bootstrap", "importing the root filesystem", size_mb=tarball.stat().st_size // 2 ** 20)
        image_id = engine.import_rootfs(tarball, tag, changes=[
            f"LABEL {SPEC_LABEL}={spec_sha}",
            f"LABEL io.ftimage.base.name={base.name}",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8",
            'CMD ["/bin/bash"]',
        ])
    log.emit("bootstrap", f"base ready: {tag}", id=image_id[:19])
    return BaseImage(ref=tag, id=image_id, reused=False)


def _trim_rootfs(rootfs: Path) -> None:
    """Drop what a container never needs: apt caches, man pages, logs (copyright files stay)."""
    for rel in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/man",
                "usr/share/info", "var/log"):
        target = rootfs / rel
        if target.is_dir():
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                elif child.name != "lock":
                    child.unlink(missing_ok=True)
