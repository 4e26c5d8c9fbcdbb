"""Which Python functions actually ran: the ground truth behind "what the layer really calls".

transformers' wrappers pick an implementation once at import, and a kernelized layer can swap it
again later, so reading attributes is not enough; we watch code objects being entered while the
model runs. sys.setprofile sees every Python-level call, including through functools.wraps and
torch.compiler.disable wrappers (we watch the innermost code object).
"""
from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import CodeType


def innermost_code(func: Callable) -> CodeType | None:
    """The code object that really runs: unwraps functools.wraps / torch.compiler.disable layers."""
    try:
        inner = inspect.unwrap(func)
    except ValueError:  # a __wrapped__ cycle
        inner = func
    return getattr(inner, "__code__", None)


@contextmanager
def watch_calls(watched: Mapping[str, CodeType | None]) -> Iterator[dict[str, int]]:
    """Yield a dict label -> number of times that code object was entered inside the block.

    Also hooks threads started inside the block (autograd may run backward on worker threads).
    """
    by_code = {code: label for label, code in watched.items() if code is not None}
    counts = {label: 0 for label in watched}

    def profiler(frame, event, arg):
        if event == "call":
            label = by_code.get(frame.f_code)
            if label is not None:
                counts[label] += 1

    previous = sys.getprofile()
    sys.setprofile(profiler)
    threading.setprofile(profiler)
    try:
        yield counts
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)
