"""A kernel wheel ready for an image: compiled (from the kernel cache) or pinned (Triton)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename


@dataclass(frozen=True, kw_only=True)
class KernelWheel:
    name: str                 # the manifest's kernel name
    key: str                  # the kernel's cache key
    filename: str
    sha256: str
    path: Path
    archs: tuple[str, ...] = ()

    @property
    def distribution(self) -> str:
        """The distribution this wheel installs, from its file name: a kernel can ship several
        (flash-linear-attention and fla-core), and each must be checked by its own name."""
        name, _, _, _ = parse_wheel_filename(self.filename)
        return str(canonicalize_name(name))

    @property
    def version(self) -> str:
        return str(parse_wheel_filename(self.filename)[1])
