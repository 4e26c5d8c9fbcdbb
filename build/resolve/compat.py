"""Compatibility facts, read from the data files in build/compat/ (never hard-coded here)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

COMPAT_DIR = Path(__file__).resolve().parents[1] / "compat"


@dataclass(frozen=True)
class ArchFact:
    name: str
    min_cuda: str
    max_cuda: str = ""

    def supported_by(self, cuda: str) -> bool:
        if Version(cuda) < Version(self.min_cuda):
            return False
        return not self.max_cuda or Version(cuda) <= Version(self.max_cuda)


@dataclass(frozen=True)
class TorchRelease:
    cuda: tuple[str, ...]
    python: SpecifierSet


@cache
def arch_facts() -> dict[str, ArchFact]:
    data = yaml.safe_load((COMPAT_DIR / "cuda_arch.yaml").read_text())["archs"]
    return {arch: ArchFact(str(v["name"]), str(v["min_cuda"]), str(v.get("max_cuda", ""))) for arch, v in data.items()}


@cache
def torch_releases() -> dict[str, TorchRelease]:
    data = yaml.safe_load((COMPAT_DIR / "torch.yaml").read_text())["releases"]
    return {str(k): TorchRelease(tuple(str(c) for c in v["cuda"]), SpecifierSet(v["python"])) for k, v in data.items()}


def torch_minor(version: str) -> str:
    release = Version(version).release
    return f"{release[0]}.{release[1]}"
