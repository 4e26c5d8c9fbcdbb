"""A safetensors file's header, read as untrusted data and checked field by field.

Layout: 8 bytes (little-endian u64 N), N bytes of JSON header, then the data section. The header
is an object: an optional `__metadata__` (str -> str) and, per tensor, an object with exactly
`dtype` (a safetensors dtype), `shape` (non-negative ints) and `data_offsets` ([begin, end] into
the data section, end - begin the bytes that dtype and shape take). As the safetensors loader
itself requires, the tensors tile the data section: no overlap, no gap, nothing after the last.

Every way a header can be wrong is one HeaderError naming the file and the tensor: never an
AttributeError, TypeError, ValueError or RecursionError from a hostile header. The JSON is parsed
with a bound on its depth (json_limits), so `[[[[...` never reaches Python's recursion limit.
"""
from __future__ import annotations

import struct
from pathlib import Path

from contracts.errors import FixableError
from entrypoint.checkpoint import json_limits

HEADER_LIMIT = 100 << 20     # the safetensors format's own limit
MAX_DEPTH = 3                # header {} > tensor {} > shape []
MAX_DIMS = 64
METADATA = "__metadata__"
FIELDS = ("data_offsets", "dtype", "shape")
# bits per element, as the safetensors crate defines its dtypes
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
MALFORMED_FIX = "re-export the model, or point model.path at an intact copy"
TRUNCATED_FIX = "copy the model again; check that the download finished"


class HeaderError(FixableError, ValueError):
    def __init__(self, message: str, fix: str = MALFORMED_FIX):
        super().__init__(message, fix)


def _is_int(value: object) -> bool:
    return type(value) is int   # a bool is not a size


def _tensor_problem(info: object) -> str | None:
    """What is wrong with one tensor's entry, or None."""
    if not isinstance(info, dict):
        return f"its entry is a JSON {type(info).__name__}, not an object"
    if sorted(info) != list(FIELDS):
        extra, missing = sorted(set(info) - set(FIELDS)), sorted(set(FIELDS) - set(info))
        return "its entry " + "; ".join(filter(None, [extra and f"has unknown field(s) {extra}",
                                                      missing and f"lacks {missing}"]))
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        return f"dtype {_short(dtype)} is not a safetensors dtype ({', '.join(DTYPE_BITS)})"
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        return f"shape {_short(shape)} is not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        return f"data_offsets {_short(offsets)} is not two integers [begin, end]"
    begin, end = offsets
    if not 0 <= begin <= end:
        return f"data_offsets {offsets} is not 0 <= begin <= end"
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8:
        return f"{dtype} x {shape} is {bits} bits, not a whole number of bytes"
    if end - begin != bits // 8:
        return f"data_offsets {offsets} hold {end - begin} bytes, but {dtype} x {shape} takes {bits // 8}"
    return None


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_header(header: object, path: Path, data_bytes: int) -> dict:
    """The header `header` of `path` (whose data section is `data_bytes` long), checked; HeaderError otherwise."""
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: its safetensors header is a JSON {type(header).__name__}, not an object")
    spans = []
    for name, info in header.items():
        if name == METADATA:
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise HeaderError(f"{path}: its {METADATA} is not an object of strings")
            continue
        problem = _tensor_problem(info)
        if problem:
            raise HeaderError(f"{path}: tensor {name!r}: {problem}")
        spans.append((info["data_offsets"][0], info["data_offsets"][1], name))
    end = max((e for _, e, _ in spans), default=0)
    if end > data_bytes:
        raise HeaderError(f"{path} is truncated: its tensors need {end} bytes of data, the file holds {data_bytes}",
                          TRUNCATED_FIX)
    cursor, previous = 0, None
    for begin, stop, name in sorted(spans):
        if begin < cursor:
            raise HeaderError(f"{path}: tensor {name!r}: its bytes {begin}..{stop} overlap tensor {previous!r}")
        if begin > cursor:
            raise HeaderError(f"{path}: tensor {name!r}: bytes {cursor}..{begin} before it belong to no tensor")
        cursor, previous = stop, name
    if cursor != data_bytes:
        raise HeaderError(f"{path}: {data_bytes - cursor} bytes after the last tensor belong to no tensor")
    return header


def read_header(path: Path) -> dict:
    """A safetensors file's header, checked against itself and the file's size."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise HeaderError(f"{path} is truncated ({size} bytes)", TRUNCATED_FIX)
        (length,) = struct.unpack("<Q", raw)
        if length > HEADER_LIMIT or 8 + length > size:
            raise HeaderError(f"{path} is truncated or not safetensors (header of {length} bytes, file of {size})",
                              TRUNCATED_FIX)
        text = fh.read(length)
    try:
        header = json_limits.loads(text, MAX_DEPTH)
    except json_limits.JsonRefused as exc:
        raise HeaderError(f"{path} has an unreadable safetensors header: {exc}") from None
    return check_header(header, path, size - 8 - length)
