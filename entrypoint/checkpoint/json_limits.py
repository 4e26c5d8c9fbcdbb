"""JSON from a checkpoint or a model folder, parsed with a bound on its nesting.

Python's json module recurses once per level: `[[[[...` ten thousand deep raises RecursionError
(and a validator walking what it returned would recurse too). The files read back here nest a
few levels at most, so the depth is measured before parsing, without recursion and in linear
time: escaped backslashes and quotes are blanked, the quotes left delimit the strings (whose
brackets do not nest), and a running sum of the brackets outside them is the depth. Text that
nests deeper than the reader allows, or whose brackets never close, is refused unparsed.
"""
from __future__ import annotations

import json

import numpy as np

CHUNK = 1 << 22   # bytes measured per numpy pass: bounded memory for a 100 MiB header


class JsonRefused(ValueError):
    """Not JSON, or JSON nested deeper than the reader allows."""


def nesting(raw: bytes) -> int | None:
    """How deep the brackets of the JSON text `raw` nest; None when they do not balance."""
    text = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")   # inside strings, escapes pair up left to right
    codes = np.frombuffer(text, dtype=np.uint8)
    in_string, depth, deepest = 0, 0, 0
    for start in range(0, len(codes), CHUNK):
        part = codes[start:start + CHUNK]
        inside = np.bitwise_xor.accumulate((part == 34).view(np.uint8)) ^ in_string   # 1 after an opening quote
        in_string = int(inside[-1])
        step = ((part == 91) | (part == 123)).astype(np.int8) - ((part == 93) | (part == 125)).astype(np.int8)
        step[inside == 1] = 0
        running = np.cumsum(step, dtype=np.int64) + depth
        if int(running.min()) < 0:
            return None
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest if depth == 0 and not in_string else None


def loads(raw: bytes, max_depth: int) -> object:
    """json.loads, refusing text nested deeper than `max_depth` before it is parsed."""
    depth = nesting(raw)
    if depth is None or depth > max_depth:
        raise JsonRefused(f"its JSON nests deeper than {max_depth} levels" if depth else
                          "it is not JSON (its brackets or quotes do not balance)")
    try:
        # decoded here, as UTF-8: json.loads(bytes) would also take UTF-16, whose escapes the scan above misses
        return json.loads(raw.decode("utf-8"))
    except RecursionError:   # not reached after the depth check; kept so no parse can raise it
        raise JsonRefused(f"its JSON nests deeper than {max_depth} levels") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError, an integer of 4300+ digits
        raise JsonRefused(f"it is not JSON ({str(exc).splitlines()[0][:120]})") from None
