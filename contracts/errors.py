"""The one error type the user sees: a message, the fix, and the field at fault.

Every part raises errors the user must act on, and every CLI prints them with their fix and maps
them to an exit code. One base keeps that the same everywhere: `fix` is always there, `render()`
is the one `error: ... / fix: ...` text, and `from_error` re-raises one part's error as another's
with the same first line and fix.

The standard library only: guard/ imports this in every Python process of the image.
"""
from __future__ import annotations

from typing import ClassVar, TypeVar

E = TypeVar("E", bound="FixableError")


def headline(exc: BaseException) -> str:
    """The first line of an error's text: the message without the fix or detail lines below it."""
    return str(exc).split("\n")[0]


class FixableError(Exception):
    """An error with what the user should do about it.

    exit_code: what a CLI exits with when this error ends it; 2 (the input is at fault) unless a
    class names the code its CLI maps it to (each CLI keeps its own mapping). fix_in_str: str(exc)
    carries the fix on its own `  fix: ...` line, for errors that travel as text (worker logs, run
    reports) without `.fix`.
    """

    exit_code: int = 2
    fix_in_str: ClassVar[bool] = False

    def __init__(self, message: str, fix: str = "", field: str | None = None) -> None:
        super().__init__(f"{message}\n  fix: {fix}" if self.fix_in_str else message)
        self.message = message
        self.fix = fix
        self.field = field

    def render(self) -> str:
        text = f"error: {self}"
        return f"{text}\n    fix: {self.fix}" if self.fix else text

    @classmethod
    def from_error(cls: type[E], exc: FixableError) -> E:
        """`exc` as this class, for a caller that reports errors of one kind: its first line and its
        fix (the detail below the first line stays with `exc`). For classes built from (message, fix)."""
        return cls(headline(exc), exc.fix)
