"""The resolved, frozen build plan: what `python -m build --plan` prints and every later
stage reads. Every kernel has a content-addressed key: the sha256 of the full tuple that
determines its bytes. Identical inputs give byte-identical plans.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from build.spec import ImageSpec, PinnedFile, SourcePatch, Toolchain
from contracts.lock import RuntimeConstraint, Specialisation

PLAN_SCHEMA = 2


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest(data: Any) -> str:
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class CompileEstimate:
    """What compiling a kernel costs: sources to compile and CPU-seconds, from the measured
    per-source cost in the manifest (on a 2-core machine)."""
    sources: int
    cpu_seconds: float

    def wall_seconds(self, jobs: int) -> float:
        """With `jobs` parallel compile jobs (never more parallel than there are sources)."""
        return self.cpu_seconds / max(1, min(jobs, self.sources))


@dataclass(frozen=True, kw_only=True)
class KernelPlan:
    name: str
    version: str
    kind: str
    import_name: str
    extension_module: str
    key: str
    key_inputs: dict[str, Any]
    sources: tuple[PinnedFile, ...]       # one sdist, or the pinned wheels of a pure-Python kernel
    patches: tuple[SourcePatch, ...]      # only those that apply to this toolchain
    build_env: dict[str, str]             # FORCE_BUILD knobs, the arch knob and the specialisation knobs
    archs: tuple[str, ...]
    forward_entry_points: tuple[str, ...]
    backward_entry_points: tuple[str, ...]
    other_entry_points: tuple[str, ...]
    replaces: tuple[str, ...]
    python_api: dict[str, str]
    profile_kernels: dict[str, tuple[str, ...]]
    runtime_requires: tuple[str, ...]
    build_requires: tuple[str, ...]
    memory_per_job_gb: float
    specialisation: Specialisation = field(default_factory=Specialisation)
    estimate: CompileEstimate | None = None
    runtime_constraints: tuple[RuntimeConstraint, ...] = ()

    @property
    def compiled(self) -> bool:
        return self.kind == "cuda-extension"

    @property
    def entry_points(self) -> tuple[str, ...]:
        return self.forward_entry_points + self.backward_entry_points + self.other_entry_points

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "version": self.version, "kind": self.kind, "key": self.key,
            "import_name": self.import_name, "extension_module": self.extension_module,
            "sources": [{"filename": s.filename, "sha256": s.sha256, "url": s.url} for s in self.sources],
            "patches": [{"path": p.path, "sha256": p.sha256, "reason": p.reason} for p in self.patches],
            "build_env": dict(sorted(self.build_env.items())), "archs": list(self.archs),
            "entry_points": {"forward": list(self.forward_entry_points),
                             "backward": list(self.backward_entry_points),
                             "other": list(self.other_entry_points)},
            "replaces": list(self.replaces), "python_api": dict(sorted(self.python_api.items())),
            "profile_kernels": {k: list(v) for k, v in sorted(self.profile_kernels.items())},
            "runtime_requires": list(self.runtime_requires), "build_requires": list(self.build_requires),
            "specialisation": asdict(self.specialisation),
            "runtime_constraints": [asdict(c) for c in self.runtime_constraints],
            "estimate": asdict(self.estimate) if self.estimate else None,
        }


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    spec: ImageSpec
    toolchain: Toolchain
    torch_wheel: PinnedFile
    kernels: tuple[KernelPlan, ...]
    python_requirements: tuple[str, ...]   # image requirements + kernels' runtime needs, sorted
    plan_key: str = ""
    body: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def tag(self) -> str:
        return f"{self.spec.name}:{self.plan_key[:12]}"

    def to_dict(self) -> dict[str, Any]:
        return {**self.body, "plan_key": self.plan_key}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"
