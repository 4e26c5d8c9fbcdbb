"""A build step that failed for a reason outside the spec (exit code 1). Spec problems are
contracts.schema Problems, raised together as build.spec.SpecErrors (exit code 2)."""
from __future__ import annotations

from contracts.errors import FixableError


class BuildFailure(FixableError):
    exit_code = 1   # build/cli/main.py: EXIT_BUILD_FAILED (the audit command exits 2 with it: nothing proven)

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message, fix)


class SigningError(FixableError):
    """A key that cannot be used (exit 2, with the fix). Here, not in build/signing.py, so the CLI can
    catch it without importing `cryptography`, which a bare GPU host running `kernels build-here`
    does not have."""

    exit_code = 2   # build/cli/main.py: EXIT_BAD_SPEC

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)
