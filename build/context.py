"""Render a complete, self-contained build context: Dockerfile, lock, SBOM, wheelhouse, app code.

The context is deterministic: the same plan, wheels and code give the same files with the
same mtimes (SOURCE_DATE_EPOCH), and its digest names exactly what the image is built from.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jinja2
from packaging.utils import parse_wheel_filename

from build.cache import CacheLayout, link_or_copy, sha256_file
from build.resolve import BuildPlan
from build.sbom import render_sbom
from build.spec import REPO_ROOT
from build.wheelhouse import Wheel, requirements_lock
from verify.lock import LOCK_PATH, BuildLock, LockedKernel, LockedPackage

TEMPLATES = Path(__file__).resolve().parent / "templates"
APP_PACKAGES = ("verify", "entrypoint")
APP_SUFFIXES = {".py", ".json", ".yaml", ".yml", ".sh", ".txt", ".jinja"}
VENV = "/opt/ftimage/venv"
APP_DIR = "/opt/ftimage/app"


@dataclass(frozen=True, kw_only=True)
class KernelWheel:
    """A kernel wheel ready for the image: from the kernel cache (compiled) or pinned (triton)."""
    name: str
    key: str
    filename: str
    sha256: str
    path: Path
    archs: tuple[str, ...] = ()
    dist_name: str = ""
    version: str = ""


@dataclass(frozen=True)
class RenderedContext:
    directory: Path
    lock: BuildLock
    digest: str
    files: int


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH if set; else the commit time of HEAD, so a checkout renders reproducibly."""
    env = os.environ.get("SOURCE_DATE_EPOCH")
    if env and env.isdigit():
        return int(env)
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%ct"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return int(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return 0


def make_lock(plan: BuildPlan, wheels: tuple[Wheel, ...], kernel_wheels: tuple[KernelWheel, ...],
              base_ids: dict[str, str]) -> BuildLock:
    kernel_files = {kw.filename for kw in kernel_wheels}
    packages = tuple(LockedPackage(name=w.name, version=w.version, filename=w.filename, sha256=w.sha256)
                     for w in sorted(wheels, key=lambda w: w.name) if w.filename not in kernel_files)
    transformers = next((p.version for p in packages if p.name == "transformers"), "")
    by_kernel: dict[str, list[KernelWheel]] = {}
    for kw in kernel_wheels:
        by_kernel.setdefault(kw.name, []).append(kw)
    kernels = []
    for k in plan.kernels:
        for kw in sorted(by_kernel.get(k.name, []), key=lambda w: w.filename):
            kernels.append(LockedKernel(
                name=kw.dist_name or k.name, version=kw.version or k.version, kind=k.kind,
                import_name=k.import_name, key=k.key, wheel=kw.filename, sha256=kw.sha256,
                extension_module=k.extension_module,
                entry_points=k.forward_entry_points + k.backward_entry_points + k.other_entry_points,
                replaces=k.replaces, archs=kw.archs))
    tc = plan.toolchain
    return BuildLock(image=plan.spec.name, plan_key=plan.plan_key, python=tc.python, torch=tc.torch_version,
                     cuda=tc.cuda, cxx11_abi=tc.cxx11_abi, compiler=tc.compiler, transformers=transformers,
                     model_family=plan.spec.model_family, target_archs=plan.spec.target_archs,
                     attn_implementation=plan.spec.attn_implementation, kernels=tuple(kernels),
                     packages=packages, base_images=dict(sorted(base_ids.items())),
                     finetune_defaults=plan.spec.finetune_defaults)


def render_template(name: str, **variables) -> str:
    """Render build/templates/<name>; StrictUndefined makes a missing variable an error, not empty text."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    return env.get_template(name).render(**variables)


def render_dockerfile(plan: BuildPlan, base_refs: dict[str, str], epoch: int) -> str:
    return render_template(
        "Dockerfile.j2",
        image=plan.spec.name, plan_key=plan.plan_key, builder_base=base_refs["builder"],
        runtime_base=base_refs["runtime"], source_date_epoch=epoch, venv=VENV, app_dir=APP_DIR,
        etc_dir=str(LOCK_PATH.parent), user=plan.spec.user.name, uid=plan.spec.user.uid,
        runtime_needs_compiler=any(k.kind == "triton" for k in plan.kernels),
        labels=image_labels(plan, base_refs, epoch))


def image_labels(plan: BuildPlan, base_refs: dict[str, str], epoch: int) -> dict[str, str]:
    created = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = {
        "org.opencontainers.image.title": plan.spec.name,
        "org.opencontainers.image.description": plan.spec.description,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.version": plan.plan_key[:12],
        "org.opencontainers.image.base.name": base_refs["runtime"],
        "io.ftimage.plan-key": plan.plan_key,
        "io.ftimage.toolchain": plan.toolchain.name,
        "io.ftimage.target-archs": ",".join(plan.spec.target_archs),
        "io.ftimage.kernels": ",".join(f"{k.name}@{k.version}" for k in plan.kernels),
        "io.ftimage.lock.path": str(LOCK_PATH),
    }
    labels.update(plan.spec.labels)
    return labels


def render_context(plan: BuildPlan, directory: Path, *, wheels: tuple[Wheel, ...], cache: CacheLayout,
                   kernel_wheels: tuple[KernelWheel, ...] = (), base_refs: dict[str, str] | None = None,
                   base_ids: dict[str, str] | None = None, epoch: int | None = None) -> RenderedContext:
    """Write the context into `directory` (replaced whole). Wheels are hard-linked from the cache."""
    epoch = source_date_epoch() if epoch is None else epoch
    base_refs = base_refs or {"builder": plan.spec.builder_base.describe(),
                              "runtime": plan.spec.runtime_base.describe()}
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "wheelhouse").mkdir(parents=True)
    lock = make_lock(plan, wheels, kernel_wheels, base_ids or {})
    inputs: list[dict[str, str]] = []
    for wheel in wheels:
        link_or_copy(cache.wheel_path(wheel.sha256, wheel.filename), directory / "wheelhouse" / wheel.filename)
        inputs.append({"path": f"wheelhouse/{wheel.filename}", "sha256": wheel.sha256, "kind": "wheel"})
    all_wheels = list(wheels)
    for kw in kernel_wheels:
        link_or_copy(kw.path, directory / "wheelhouse" / kw.filename)
        inputs.append({"path": f"wheelhouse/{kw.filename}", "sha256": kw.sha256, "kind": "kernel-wheel",
                       "key": kw.key})
        name, version, _, _ = parse_wheel_filename(kw.filename)
        all_wheels.append(Wheel(name=str(name), version=str(version), filename=kw.filename, sha256=kw.sha256))
    texts = {
        "wheelhouse/requirements.lock.txt": requirements_lock(tuple(all_wheels)),
        "build.lock.json": lock.to_json(),
        "sbom.cdx.json": render_sbom(lock, epoch),
        "plan.json": plan.to_json(),
        "Dockerfile": render_dockerfile(plan, base_refs, epoch),
    }
    for rel, text in texts.items():
        (directory / rel).write_text(text)
    for package in APP_PACKAGES:
        _copy_app(REPO_ROOT / package, directory / "app" / package)
    for path in sorted((directory / "app").rglob("*")):
        if path.is_file():
            inputs.append({"path": str(path.relative_to(directory)), "sha256": sha256_file(path), "kind": "code"})
    for rel in sorted(texts):
        inputs.append({"path": rel, "sha256": hashlib.sha256(texts[rel].encode()).hexdigest(), "kind": "rendered"})
    inputs.sort(key=lambda i: i["path"])
    (directory / "inputs.json").write_text(json.dumps(inputs, indent=1, sort_keys=True) + "\n")
    (directory / ".dockerignore").write_text("inputs.json\nplan.json\n")
    _normalise_mtimes(directory, epoch)
    context_digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return RenderedContext(directory=directory, lock=lock, digest=context_digest, files=len(inputs))


def _copy_app(src: Path, dest: Path) -> None:
    for path in sorted(src.rglob("*")):
        if path.is_file() and path.suffix in APP_SUFFIXES and "__pycache__" not in path.parts:
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            if os.access(path, os.X_OK):
                target.chmod(0o755)


def _normalise_mtimes(directory: Path, epoch: int) -> None:
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            os.utime(path, (epoch, epoch))
