"""Hypothesis fuzz of what a run reads back from disk, in-process: a checkpoint's state files
(trainer_state.json and the marker) and a model's safetensors headers. Reading either yields a
validated result or the one named refusal (a damaged checkpoint; a SourceCheckpointError with the
file, the tensor and the fix), never another exception, and never a RecursionError."""
from __future__ import annotations

import copy
import json
import math
import shutil
import struct

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from entrypoint.checkpoint.dcp import MARKER, TRAINER_STATE, CheckpointError, read_state
from entrypoint.checkpoint.hf_safetensors import SINGLE, SourceCheckpointError, check_source
from entrypoint.checkpoint.safetensors_header import DTYPE_BITS
from tests.fixtures.checkpoints import save_checkpoints

pytestmark = pytest.mark.unit
EXAMPLES = 200

HOSTILE_NUMBER = st.sampled_from([0, 1, -1, 4, 2, 3, 10 ** 18, -(10 ** 18), 2 ** 63, 2 ** 64 + 1, 10 ** 400,
                                  0.0, 2.5, 4.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e308]) | \
    st.integers() | st.floats(allow_nan=True, allow_infinity=True)
HOSTILE_LEAF = HOSTILE_NUMBER | st.booleans() | st.none() | st.sampled_from(
    ["", "abc", "4", "true", "null", "NaN", "0123456789abcdef", "0123456789ABCDEF", "x" * 70000, "../x",
     "F32", "__metadata__", "\u2028", "\x00"]) | st.text(max_size=12)
HOSTILE_VALUE = st.recursive(HOSTILE_LEAF, lambda inner: st.lists(inner, max_size=3) |
                             st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# deeper than any reader allows (16 for state files, 3 for headers), shallow enough for json.dumps here;
# the 100k-deep cases are raw bytes below
DEEP = st.integers(min_value=4, max_value=200).map(_nested)


def _paths(tree, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(tree, dict):
        for key, value in tree.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(tree, list):
        for i, value in enumerate(tree[:3]):
            out += _paths(value, prefix + (i,))
    return out


def _apply(doc, op):
    """One mutation of a JSON document: set, delete or add at a path (missing paths are skipped)."""
    kind, path, value = op
    if kind == "keep" or not path:   # keep: the document as it is (an accepted example now and then)
        return value if kind == "set" else doc
    node = doc
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return doc
    leaf = path[-1]
    try:
        if kind == "set":
            node[leaf] = value
        elif kind == "delete":
            del node[leaf]
        elif isinstance(node, dict):
            node[f"{leaf}_extra"] = value
    except (KeyError, IndexError, TypeError):
        pass
    return doc


@pytest.fixture(scope="module")
def saved_step(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-ckpt")
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    try:
        save_checkpoints(root / "checkpoints", [4])
    finally:
        dist.destroy_process_group()
    step = root / "checkpoints" / "step-00000004"
    return step, (step / TRAINER_STATE).read_bytes(), (step / MARKER).read_bytes()


_STATE_PATHS = None


def _state_paths(saved_step) -> list[tuple]:
    global _STATE_PATHS
    if _STATE_PATHS is None:
        _STATE_PATHS = [()] + _paths(json.loads(saved_step[1]))
    return _STATE_PATHS


OPS = st.tuples(st.sampled_from(["set", "set", "delete", "add", "keep"]), st.integers(min_value=0, max_value=10 ** 6),
                HOSTILE_VALUE | DEEP)
MARKER_OPS = st.tuples(st.sampled_from(["set", "delete", "add"]),
                       st.sampled_from([(), ("step",), ("world_size",)]), HOSTILE_VALUE | DEEP)


def _check_valid(state) -> None:
    """What an accepted state guarantees, checked here independently of the reader."""
    assert type(state.step) is int and state.step == 4 and state.step <= state.total_steps
    assert type(state.world_size) is int and state.world_size >= 1
    assert type(state.sampler.position) is int and 0 <= state.sampler.position <= 4 * (state.max_step_items or 2 ** 20)
    assert all(type(x) is float and math.isfinite(x) for x in state.scheduler.base_lrs)
    assert state.scheduler.last_epoch == 4 and isinstance(state.complete, bool)
    assert len(state.data_fingerprint.sha256) == 16
    json.dumps(state.to_dict(), allow_nan=False)   # finite, plain JSON


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state_ops=st.lists(OPS, max_size=4), marker_ops=st.lists(MARKER_OPS, max_size=2),
       raw=st.none() | st.none() | st.none() | st.binary(max_size=32) | st.sampled_from(
           [b"[" * 200_000, b"{" * 50_000, b'{"step": 4', b"\xff", b"", b"1e999", b'{"step": ' + b"9" * 5000 + b"}"]),
       raw_target=st.sampled_from([TRAINER_STATE, MARKER]))
def test_fuzz_checkpoint_state_files(saved_step, state_ops, marker_ops, raw, raw_target):
    step_dir, state_bytes, marker_bytes = saved_step
    paths = _state_paths(saved_step)
    state_doc = json.loads(state_bytes)
    for kind, which, value in state_ops:
        state_doc = _apply(state_doc, (kind, paths[which % len(paths)], copy.deepcopy(value)))
    marker_doc = json.loads(marker_bytes)
    for op in marker_ops:
        marker_doc = _apply(marker_doc, op)
    (step_dir / TRAINER_STATE).write_text(json.dumps(state_doc, allow_nan=True))
    (step_dir / MARKER).write_text(json.dumps(marker_doc, allow_nan=True))
    if raw is not None:
        (step_dir / raw_target).write_bytes(raw)
    try:
        try:
            state = read_state(step_dir)
        except CheckpointError as exc:
            line = str(exc).splitlines()[0]
            assert line.startswith(("step-00000004 is damaged: ", "step-00000004 was refused: ")), line
            assert len(str(exc).splitlines()) == 2 and exc.fix
            # the saved state itself is valid
            assert raw is not None or any(op[0] != "keep" for op in state_ops) or marker_ops
            event("damaged")
        else:
            _check_valid(state)
            event("validated")
    finally:
        (step_dir / TRAINER_STATE).write_bytes(state_bytes)
        (step_dir / MARKER).write_bytes(marker_bytes)


# --- safetensors headers -------------------------------------------------------------------

def expected_valid(header, data_bytes: int) -> bool:
    """The header rules, written out independently of safetensors_header.py."""
    if not isinstance(header, dict):
        return False
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                return False
            continue
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}):
            return False
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not (isinstance(dtype, str) and dtype in DTYPE_BITS and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape) and isinstance(offsets, list)
                and len(offsets) == 2 and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            return False
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            return False
        spans.append(tuple(offsets))
    cursor = 0
    for begin, end in sorted(spans):
        if begin != cursor:
            return False
        cursor = end
    return cursor == data_bytes


TENSOR = st.tuples(st.sampled_from(sorted(DTYPE_BITS)), st.lists(st.integers(min_value=0, max_value=6), max_size=3))


def _valid_header(tensors) -> tuple[dict, int]:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for i, (dtype, shape) in enumerate(tensors):
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8:
            shape = shape + [2]   # sub-byte dtypes: an even count of 4-bit elements
            bits *= 2
            if bits % 8:
                shape, bits = [8], 8 * DTYPE_BITS[dtype]
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bits // 8]}
        offset += bits // 8
    return header, offset


HEADER_FIELDS = [("dtype",), ("shape",), ("data_offsets",), ("data_offsets", 0), ("data_offsets", 1), ("shape", 0),
                 ("extra",)]
HEADER_OPS = st.tuples(st.sampled_from(["set", "set", "delete", "add", "keep"]), st.integers(min_value=0, max_value=7),
                       st.sampled_from(HEADER_FIELDS), HOSTILE_VALUE | DEEP | st.integers(min_value=-4, max_value=64))


@pytest.fixture(scope="module")
def header_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-headers")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=st.lists(TENSOR, min_size=0, max_size=6), ops=st.lists(HEADER_OPS, max_size=3),
       whole=st.none() | HOSTILE_VALUE | DEEP, metadata=st.none() | HOSTILE_VALUE,
       slack=st.sampled_from([0, 0, 0, 1, -1, 7]),
       raw=st.none() | st.sampled_from([b"[" * 300_000, b'{"a": {"dtype": "F32", "shape": ' + b"[" * 5000,
                                        b"\xff\xfe", b"{}" * 1000]))
def test_fuzz_safetensors_headers(header_dir, tensors, ops, whole, metadata, slack, raw):
    header, data_bytes = _valid_header(tensors)
    names = [n for n in header if n != "__metadata__"]
    for kind, which, path, value in ops:
        if names:
            header = _apply(header, (kind, (names[which % len(names)],) + path, copy.deepcopy(value)))
    if metadata is not None:
        header["__metadata__"] = metadata
    if whole is not None:
        header = whole
    data = max(data_bytes + slack, 0)
    body = raw if raw is not None else json.dumps(header, allow_nan=True).encode()
    folder = header_dir / "model"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / SINGLE).write_bytes(struct.pack("<Q", len(body)) + body + bytes(data))
    valid = raw is None and expected_valid(json.loads(body), data)
    try:
        check_source(folder)
    except SourceCheckpointError as exc:
        assert not valid, f"a valid header was refused: {exc}"
        assert str(folder / SINGLE) in str(exc).splitlines()[0] and exc.fix
        assert len(str(exc).splitlines()) == 2   # the problem on one line, then the fix
        event("refused")
    else:
        event("accepted")
        assert valid, f"an invalid header was accepted: {body[:300]!r} with {data} data bytes"
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), "np") as fh:   # what we accept, the real loader opens
            assert sorted(fh.keys()) == sorted(n for n in json.loads(body) if n != "__metadata__")
    if not ops and metadata is None and whole is None and slack == 0 and raw is None:
        assert valid
