"""Per-rank RNG state as JSON: torch (and CUDA) generator bytes in base64, numpy's MT19937
state and Python's as plain lists. Data only: nothing in a checkpoint is unpickled.

Read back, a state is first checked field by field (RngState, through contracts/schema.py:
types, ranges, lengths, bools never standing for ints), then each generator's state is set
on a scratch generator of its kind, so whatever torch, numpy or Python would refuse is refused
here, as RngStateError, before the rank's own generators are touched (parse); the CUDA state is
checked as torch checks it. apply() then cannot fail.
"""
from __future__ import annotations

import base64
import binascii
import math
import random
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from contracts.schema import Problems, Reader, rule

FORMAT = 1
FIX = "restore the checkpoint from an intact copy, or resume another one"
MT_WORDS = 624                      # MT19937's state: 624 32-bit words and a position
BASE64 = r"[A-Za-z0-9+/]*={0,2}"
CUDA_STATE_BYTES = (8, 16)          # Philox seed (and offset)


class RngStateError(ValueError):
    """The saved state is not the shape this module writes."""


def capture() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"format": FORMAT,
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)},
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _finite(value):
    if value is not None and not math.isfinite(value):
        return f"{value!r} is not a finite number", FIX
    return None


def _words(n: int, *, last_max: int | None = None):
    """A check: exactly n 32-bit words (Python's state adds a position after them)."""
    def check(values: list[int]):
        want = n + (last_max is not None)
        if len(values) != want:
            return f"holds {len(values)} values, not {want}", FIX
        words = values[:n]
        if any(not 0 <= v < 2 ** 32 for v in words):
            return "holds a value outside 0 .. 2**32-1", FIX
        if last_max is not None and not 0 <= values[-1] <= last_max:
            return f"ends in position {values[-1]}, outside 0 .. {last_max}", FIX
        return None
    return check


@dataclass(kw_only=True)
class NumpyState:
    name: Literal["MT19937"]
    keys: list[int] = field(metadata=rule(check=_words(MT_WORDS)))
    pos: int = field(metadata=rule(ge=0, le=MT_WORDS))
    has_gauss: int = field(metadata=rule(ge=0, le=1))
    cached_gaussian: float = field(metadata=rule(check=_finite))


@dataclass(kw_only=True)
class PythonState:
    version: int = field(metadata=rule(ge=3, le=3))
    internal: list[int] = field(metadata=rule(check=_words(MT_WORDS, last_max=MT_WORDS)))
    gauss_next: float | None = field(metadata=rule(check=_finite))


@dataclass(kw_only=True)
class RngState:
    format: Literal[1]
    torch_state: str = field(metadata=rule(key="torch", pattern=BASE64, pattern_fix=FIX))
    numpy: NumpyState
    python: PythonState
    cuda: str | None = field(default=None, metadata=rule(pattern=BASE64))
    torch_bytes: torch.Tensor = field(init=False, repr=False)
    cuda_bytes: torch.Tensor | None = field(init=False, repr=False, default=None)


def _bytes(text: str, what: str) -> torch.Tensor:
    try:
        raw = base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError):
        raise RngStateError(f"{what}: not base64 text") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def parse(raw: object, file: str = "rng state") -> RngState:
    """The validated state in `raw` (what capture() wrote), or RngStateError naming the field."""
    problems = Problems()
    state = Reader(file, problems).read(RngState, raw)
    if problems or state is None:
        first = problems.items[0] if problems else None
        raise RngStateError(f"{first.field}: {first.problem}" if first else "not an RNG state")
    state.torch_bytes = _bytes(state.torch_state, "torch")
    try:   # a scratch generator of each kind: what the library refuses, it refuses here
        torch.Generator().set_state(state.torch_bytes)
    except RuntimeError as exc:
        raise RngStateError(f"torch: {str(exc).splitlines()[0]}") from None
    n = state.numpy
    try:
        np.random.RandomState().set_state((n.name, np.asarray(n.keys, dtype=np.uint32), n.pos, n.has_gauss,
                                           n.cached_gaussian))
    except (ValueError, TypeError, OverflowError) as exc:
        raise RngStateError(f"numpy: {exc}") from None
    try:
        random.Random().setstate((state.python.version, tuple(state.python.internal), state.python.gauss_next))
    except (ValueError, TypeError, OverflowError) as exc:
        raise RngStateError(f"python: {exc}") from None
    if state.cuda is not None:
        # checked as torch's CUDA generator checks it, without a scratch CUDA generator: that would
        # create a CUDA context (and hold GPU memory) in the launcher, which reads every rank's file
        cuda = _bytes(state.cuda, "cuda")
        if cuda.numel() not in CUDA_STATE_BYTES:
            raise RngStateError(f"cuda: {cuda.numel()} bytes, not a CUDA generator state")
        if cuda.numel() == 16 and int.from_bytes(cuda.numpy().tobytes()[8:], "little") % 4:
            raise RngStateError("cuda: its Philox offset is not a multiple of 4")
        state.cuda_bytes = cuda
    return state


def apply(state: RngState) -> None:
    """Set this process's generators to a state parse() validated."""
    n, p = state.numpy, state.python
    torch.set_rng_state(state.torch_bytes)
    np.random.set_state((n.name, np.asarray(n.keys, dtype=np.uint32), n.pos, n.has_gauss, n.cached_gaussian))
    random.setstate((p.version, tuple(p.internal), p.gauss_next))
    if state.cuda_bytes is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state.cuda_bytes)


def restore(raw: object) -> None:
    """Apply a state written by capture(); RngStateError if any part of it is malformed."""
    apply(parse(raw))
