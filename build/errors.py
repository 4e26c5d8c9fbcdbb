"""A build step that failed for a reason outside the spec (exit code 1). Spec problems are
contracts.schema Problems, raised together as build.spec.SpecErrors (exit code 2)."""
from __future__ import annotations


class BuildFailure(Exception):
    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.fix = fix

    def render(self) -> str:
        text = f"error: {self}"
        return f"{text}\n    fix: {self.fix}" if self.fix else text


class SigningError(Exception):
    """A key that cannot be used (exit 2, with the fix). Here, not in build/signing.py, so the CLI can
    catch it without importing `cryptography`, which a bare GPU host running `kernels build-here`
    does not have."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix
