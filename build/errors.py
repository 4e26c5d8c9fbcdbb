"""Typed, collected errors. Every problem a user can cause names the file, the field and the fix."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpecProblem:
    file: str      # the file the problem is in (as the user named it)
    field: str     # dotted path to the field, e.g. "kernels.flash-attn.source.sdist.sha256"
    problem: str
    fix: str
    code: str = "invalid"  # stable machine-readable kind, e.g. "missing-field", "arch-cuda"

    def render(self) -> str:
        return f"{self.file}: {self.field}: {self.problem}\n    fix: {self.fix}"


class SpecErrors(Exception):
    """All problems found in a spec, reported together (exit code 2)."""

    def __init__(self, problems: list[SpecProblem]):
        super().__init__(f"{len(problems)} problem(s) in the build spec")
        self.problems = problems

    def render(self) -> str:
        lines = [f"error: the build spec has {len(self.problems)} problem(s):"]
        lines += [p.render() for p in self.problems]
        return "\n".join(lines)


class BuildFailure(Exception):
    """A build step failed for a reason outside the spec (exit code 1)."""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.fix = fix

    def render(self) -> str:
        text = f"error: {self}"
        return f"{text}\n    fix: {self.fix}" if self.fix else text


class Problems:
    """Collects problems while a loader walks a document, so all are reported at once."""

    def __init__(self) -> None:
        self.items: list[SpecProblem] = []

    def add(self, file: str | Path, field: str, problem: str, fix: str, code: str = "invalid") -> None:
        self.items.append(SpecProblem(str(file), field, problem, fix, code))

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecErrors(list(self.items))
