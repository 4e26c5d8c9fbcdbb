"""Render a complete, self-contained build context: Dockerfile, lock, SBOM, wheelhouse, app code.

The context is deterministic: the same plan, wheels and code give the same files with the same
mtimes (SOURCE_DATE_EPOCH), and its digest names exactly what the image is built from. Labels
are not Dockerfile text: they go to the engine as data (the build API's `labels`), so no spec
value is ever parsed as a Dockerfile instruction or expanded as a variable.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.utils import parse_wheel_filename

import guard
from build.cache import CacheLayout, link_or_copy, sha256_file
from build.context import render_target
from build.context.dpkg_status import DebPackage
from build.context.lockfile import make_lock
from build.context.sbom import render_sbom
from build.resolve import BuildPlan
from build.source_date import source_date_epoch
from build.spec import REPO_ROOT
from build.templating import render_template
from build.wheelhouse import Wheel, requirements_lock
from contracts import folder_guard
from contracts.lock import LOCK_PATH, BuildLock

if TYPE_CHECKING:   # the wheel type only, for annotations: kernels/build_here.py makes locks with
    # this folder, so a runtime import back into kernels/ would close a cycle
    from build.kernels.wheel import KernelWheel

# What runs in the image, and nothing else: no tests, no fixtures, no dev tools.
APP_PACKAGES = ("contracts", "families", "verify", "guard", "entrypoint")
APP_SUFFIXES = {".py", ".json", ".yaml"}
VENV = "/opt/ftimage/venv"
APP_DIR = "/opt/ftimage/app"
GATE = "/opt/ftimage/bin/ftimage-gate"
DROP_INSTALLED_FILES = Path(__file__).with_name("drop_installed_files.py")


@dataclass(frozen=True)
class RenderedContext:
    directory: Path
    lock: BuildLock
    labels: dict[str, str]
    digest: str
    files: int


def guard_pth_lines() -> list[tuple[str, str]]:
    """The runtime guard's .pth files as (name, line) for the classic Dockerfile's echo: constants of
    the guard package, checked to be one plain line each before they reach a shell line."""
    out = []
    for name, data in sorted(guard.install_files().items()):
        line = data.decode().rstrip("\n")
        if not re.fullmatch(r"[a-z0-9-]+\.pth", name) or not re.fullmatch(r"import [a-z_.]+(; [a-z_.]+\(\))?", line):
            raise ValueError(f"the guard's .pth {name!r} is not one plain import line")
        out.append((name, line))
    return out


def render_dockerfile(plan: BuildPlan, base_refs: dict[str, str], epoch: int) -> str:
    spec = plan.spec
    return render_template(
        "Dockerfile.j2",
        image=spec.name, plan_key=plan.plan_key, builder_base=base_refs["builder"],
        runtime_base=base_refs["runtime"], source_date_epoch=epoch, venv=VENV, app_dir=APP_DIR,
        guard_pth=guard_pth_lines(),
        etc_dir=str(LOCK_PATH.parent), user=spec.user.name, uid=spec.user.uid, gid=spec.gid, gate=GATE,
        python_minor=plan.toolchain.python, runtime_needs_compiler=any(k.kind == "triton" for k in plan.kernels))


def image_labels(plan: BuildPlan, base_refs: dict[str, str], epoch: int) -> dict[str, str]:
    """User labels first, then the build's own, which a spec can never override (validate.py
    refuses those keys; this order makes sure of it)."""
    created = datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = dict(plan.spec.labels)
    labels.update({
        "org.opencontainers.image.title": plan.spec.name,
        "org.opencontainers.image.description": plan.spec.description,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.version": plan.plan_key[:12],
        "org.opencontainers.image.base.name": base_refs["runtime"],
        "io.ftimage.plan-key": plan.plan_key,
        "io.ftimage.toolchain": plan.toolchain.name,
        "io.ftimage.target-archs": ",".join(plan.spec.target_archs),
        "io.ftimage.kernels": ",".join(f"{k.name}@{k.version}" for k in plan.kernels),
        "io.ftimage.model-family": ",".join(plan.spec.families),
        "io.ftimage.lock.path": str(LOCK_PATH),
        "io.ftimage.gate": GATE,
    })
    return labels


def render_context(plan: BuildPlan, directory: Path, *, wheels: tuple[Wheel, ...], cache: CacheLayout,
                   kernel_wheels: tuple[KernelWheel, ...] = (), base_refs: dict[str, str] | None = None,
                   base_ids: dict[str, str] | None = None, epoch: int | None = None,
                   base_packages: tuple[DebPackage, ...] = (), force: bool = False,
                   sbom_epoch: int | None = None, lock_build: dict[str, str] | None = None,
                   wheel_files: bool = True) -> RenderedContext:
    """Write the context into `directory` (see render_target.py for what may be replaced there).
    Wheels are hard-linked from the cache: each the file itself, never a link planted there, and
    of the size its resolution recorded (cache.link_or_copy). `wheel_files=False` (a resolution
    from the registry, whose venv layer is too): the wheelhouse names the wheels in its lock but
    holds none of them, and the digest is the same, since it is made of their sha256s."""
    epoch = source_date_epoch() if epoch is None else epoch
    base_refs = base_refs or {"builder": plan.spec.builder_base.describe(),
                              "runtime": plan.spec.runtime_base.describe()}
    staging = render_target.staging_beside(directory)
    try:
        lock, labels, inputs = _write(plan, staging, wheels, cache, kernel_wheels, base_refs, base_ids or {}, epoch,
                                      base_packages, epoch if sbom_epoch is None else sbom_epoch, lock_build,
                                      wheel_files)
        context_digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
        render_target.publish_render(staging, directory, force=force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _normalise_mtimes(directory, epoch)
    return RenderedContext(directory=directory, lock=lock, labels=labels, digest=context_digest, files=len(inputs))


def _write(plan, directory, wheels, cache, kernel_wheels, base_refs, base_ids, epoch, base_packages, sbom_epoch,
           lock_build=None, wheel_files=True):
    (directory / "wheelhouse").mkdir(parents=True)
    lock = make_lock(plan, wheels, kernel_wheels, base_ids, build=lock_build)
    inputs: list[dict[str, str]] = []
    for wheel in wheels:
        if wheel_files:
            link_or_copy(cache.wheel_path(wheel.sha256, wheel.filename), directory / "wheelhouse" / wheel.filename,
                         size=wheel.size)
        inputs.append({"path": f"wheelhouse/{wheel.filename}", "sha256": wheel.sha256, "kind": "wheel"})
    all_wheels = list(wheels)
    for kw in kernel_wheels:
        if wheel_files or kw.path.is_file():    # a kernel's pinned wheels stay unfetched with the closure's
            link_or_copy(kw.path, directory / "wheelhouse" / kw.filename)
        inputs.append({"path": f"wheelhouse/{kw.filename}", "sha256": kw.sha256, "kind": "kernel-wheel",
                       "key": kw.key})
        name, version, _, _ = parse_wheel_filename(kw.filename)
        all_wheels.append(Wheel(name=str(name), version=str(version), filename=kw.filename, sha256=kw.sha256))
    labels = image_labels(plan, base_refs, epoch)
    texts = {
        "wheelhouse/requirements.lock.txt": requirements_lock(tuple(all_wheels)),
        "build.lock.json": lock.to_json(),
        "sbom.cdx.json": render_sbom(lock, sbom_epoch, base_packages),
        "plan.json": plan.to_json(),
        "labels.json": json.dumps(labels, sort_keys=True, indent=2) + "\n",
        "Dockerfile": render_dockerfile(plan, base_refs, epoch),
    }
    texts["ftimage-gate"] = gate_script()
    texts["wheelhouse/drop_installed_files.py"] = DROP_INSTALLED_FILES.read_text()
    for rel, text in texts.items():
        (directory / rel).write_text(text)
    stage_app(directory / "app")
    for path in sorted((directory / "app").rglob("*")):
        if path.is_file():
            inputs.append({"path": str(path.relative_to(directory)), "sha256": sha256_file(path), "kind": "code"})
    for rel in sorted(texts):
        inputs.append({"path": rel, "sha256": hashlib.sha256(texts[rel].encode()).hexdigest(), "kind": "rendered"})
    inputs.sort(key=lambda i: i["path"])
    (directory / "inputs.json").write_text(json.dumps(inputs, indent=1, sort_keys=True) + "\n")
    (directory / ".dockerignore").write_text("inputs.json\nplan.json\nlabels.json\n.ftimage-render\n")
    return lock, labels, inputs


def gate_script() -> str:
    """The gate the image runs a command through (the app layer holds it beside the app)."""
    return render_template("ftimage-gate.j2", venv=VENV)


def stage_app(app: Path) -> None:
    """The app folder as the image holds it: each runtime package's files (copy_app)."""
    for package in APP_PACKAGES:
        copy_app(REPO_ROOT / package, app / package)


def copy_app(src: Path, dest: Path) -> None:
    """The package's runtime files only: no caches, no test modules. A symbolic link is copied
    only when what it points to lies inside the package: a committed link to a file outside the
    checkout must never ship that file in the image."""
    root = Path(os.path.realpath(src))
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if "__pycache__" in rel.parts:
            continue
        real = Path(os.path.realpath(path))
        if real != root and root not in real.parents:
            raise folder_guard.UnsafeFolder(
                f"{path} is a symbolic link to {real}, outside {src}: the image would ship a file from outside "
                "the checkout", f"replace the link with the file itself, or remove it ({rel})")
        if not path.is_file() or path.suffix not in APP_SUFFIXES:
            continue
        if path.name.startswith("test_") or path.name == "conftest.py":
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def _normalise_mtimes(directory: Path, epoch: int) -> None:
    """Fixed mtimes and modes: COPY keeps both, so neither may come from this machine (a
    builder's umask 077 would leave the lock unreadable to the image's non-root user)."""
    executable = {directory / "ftimage-gate"}
    for path in [directory, *directory.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod(0o755 if path.is_dir() or path in executable else 0o644)
        os.utime(path, (epoch, epoch))
