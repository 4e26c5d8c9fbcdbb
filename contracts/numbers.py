"""Numbers at their limits, for the validation engine (schema.py): every number a document gives
is finite (no nan, no inf, no integer too large for a float read as a float), every integer fits
in signed 64 bits (what numpy and torch take), and a field's range reads as words in its message
("a finite number > 0 and <= 0.5"), from the same bounds the check uses.
"""
from __future__ import annotations

import math
from typing import Any

INT_LIMIT = 1 << 63


def allowed_range(meta: dict, *, integer: bool = False) -> str:
    """The range a field's rule allows (ge / gt / le), in words."""
    lo, gt, hi = meta.get("ge"), meta.get("gt"), meta.get("le")
    low = f">= {lo}" if lo is not None else f"> {gt}" if gt is not None else ""
    high = f"<= {hi}" if hi is not None else "< 2**63" if integer else ""
    bounds = " and ".join(b for b in (low, high) if b)
    return ("an integer" if integer else "a finite number") + (f" {bounds}" if bounds else "")


def range_problem(value: Any, meta: dict, *, integer: bool) -> str | None:
    """None when `value` is finite (or a 64-bit integer) and within the rule's bounds; else what
    is wrong with it, naming the allowed range. An integer too large for a float (a float field
    given 10**400) is not finite either."""
    if integer:
        finite = -INT_LIMIT <= value < INT_LIMIT
    else:
        try:
            finite = math.isfinite(value)
        except OverflowError:
            finite = False
    lo, gt, hi = meta.get("ge"), meta.get("gt"), meta.get("le")
    if finite and (lo is None or value >= lo) and (gt is None or value > gt) and (hi is None or value <= hi):
        return None
    what = "is out of range" if finite or integer else "is not a finite number"
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} {what} (allowed: {allowed_range(meta, integer=integer)})"
