"""Resolve an image's kernels for THIS machine: its Python, its installed torch and CUDA, its
GPU arch. Used to compile and prove the kernels on a GPU host that has no Docker (`python -m
build kernels build-here`), with the same sources, patches, knobs and specialisation as the
image; only the toolchain is observed instead of pinned.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import subprocess
import sys

from build.resolve import BuildPlan, resolve
from build.spec import ImageSpec, Manifest, PinnedFile, Toolchain
from build.spec.shapes import TorchPin
from contracts.schema import Problems


def observed_toolchain() -> tuple[Toolchain, PinnedFile]:
    """This interpreter's toolchain, and an identity for its torch (the sha256 of torch's
    installed RECORD, which lists the sha256 of every installed file)."""
    import torch  # seconds to load: the build CLI (`--plan` too) imports this module, only build-here needs torch

    try:
        version = subprocess.run(["gcc", "-dumpversion"], capture_output=True, text=True).stdout.strip()
    except OSError:
        version = "0"
    tc = Toolchain(python=f"{sys.version_info.major}.{sys.version_info.minor}",
                   torch=TorchPin(version=torch.__version__, wheels={}), cuda=str(torch.version.cuda or "cpu"),
                   cxx11_abi=bool(torch.compiled_with_cxx11_abi()), compiler=f"gcc-{version.split('.')[0]}")
    object.__setattr__(tc, "name", "host")
    record = importlib.metadata.distribution("torch").read_text("RECORD") or torch.__version__
    identity = PinnedFile(filename=f"torch-{torch.__version__} (installed)",
                          sha256=hashlib.sha256(record.encode()).hexdigest())
    return tc, identity


def with_archs(spec: ImageSpec, archs: tuple[str, ...]) -> ImageSpec:
    """The same spec for other target archs (a GPU host builds for its own)."""
    new = dataclasses.replace(spec, target_archs=tuple(archs))
    for f in dataclasses.fields(spec):
        if not f.init:
            object.__setattr__(new, f.name, getattr(spec, f.name))
    return new


def resolve_for_host(spec: ImageSpec, manifest: Manifest, archs: tuple[str, ...],
                     problems: Problems | None = None) -> BuildPlan:
    return resolve(with_archs(spec, archs), manifest, problems, host=observed_toolchain())


def host_arch() -> str | None:
    import torch  # as in observed_toolchain()

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}"
