"""A model folder's safetensors headers are untrusted input: every field is checked
(checkpoint/safetensors_header.py), and each way one is wrong is one SourceCheckpointError (the
launcher's exit 2) naming the file and the tensor, with the fix. Never an AttributeError,
TypeError, ValueError or RecursionError."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from entrypoint.checkpoint.hf_safetensors import SINGLE, SourceCheckpointError, check_source

pytestmark = pytest.mark.unit
FIX = "re-export the model, or point model.path at an intact copy"


def write_safetensors(path: Path, header, data_bytes: int) -> Path:
    """A safetensors file with `header` (an object, or raw JSON bytes) and `data_bytes` of zeros."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_bytes))
    return path


def _model(tmp_path: Path, header, data_bytes: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    write_safetensors(folder / SINGLE, header, data_bytes)
    return folder


def _t(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_a_valid_header_is_accepted(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "a": _t(), "b": _t("BF16", (3, 1), (8, 14)),
              "empty": _t("I64", (0, 4), (14, 14)), "f4": _t("F4", (4,), (14, 16))}
    assert sorted(check_source(_model(tmp_path, header, 16))) == ["a", "b", "empty", "f4"]


def test_a_header_written_by_safetensors_itself_is_accepted(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "model").mkdir()
    save_file({"w": torch.zeros(3, 5), "b": torch.ones(7, dtype=torch.bfloat16), "i": torch.arange(4)},
              str(tmp_path / "model" / SINGLE), metadata={"format": "pt"})
    assert sorted(check_source(tmp_path / "model")) == ["b", "i", "w"]


@pytest.mark.parametrize("header, data, tensor, problem", [
    ([_t()], 8, None, "is a JSON list, not an object"),
    ("just text", 8, None, "is a JSON str, not an object"),
    ({"a": [0, 8]}, 8, "a", "its entry is a JSON list, not an object"),
    ({"a": "F32"}, 8, "a", "its entry is a JSON str, not an object"),
    ({"a": None}, 8, "a", "its entry is a JSON NoneType, not an object"),
    ({"a": {**_t(), "extra": 1}}, 8, "a", "has unknown field(s) ['extra']"),
    ({"a": {"dtype": "F32", "shape": [2]}}, 8, "a", "lacks ['data_offsets']"),
    ({"a": _t(dtype="F33")}, 8, "a", "dtype 'F33' is not a safetensors dtype"),
    ({"a": _t(dtype=["F32"])}, 8, "a", "is not a safetensors dtype"),
    ({"a": _t(shape=(-2,))}, 8, "a", "is not a list of non-negative integers"),
    ({"a": _t(shape=(True, 2))}, 8, "a", "is not a list of non-negative integers"),
    ({"a": _t(shape=(2.0,))}, 8, "a", "is not a list of non-negative integers"),
    ({"a": {**_t(), "shape": "2"}}, 8, "a", "is not a list of non-negative integers"),
    ({"a": _t(offsets=(0,))}, 8, "a", "is not two integers"),
    ({"a": _t(offsets=(0, 8, 16))}, 8, "a", "is not two integers"),
    ({"a": _t(offsets=(0, "8"))}, 8, "a", "is not two integers"),
    ({"a": _t(offsets=(0, 8.0))}, 8, "a", "is not two integers"),
    ({"a": _t(offsets=(False, 8))}, 8, "a", "is not two integers"),
    ({"a": {**_t(), "data_offsets": {"begin": 0}}}, 8, "a", "is not two integers"),
    ({"a": _t(offsets=(-8, 0))}, 8, "a", "is not 0 <= begin <= end"),
    ({"a": _t(offsets=(8, 0))}, 8, "a", "is not 0 <= begin <= end"),
    ({"a": _t(offsets=(0, 4))}, 8, "a", "hold 4 bytes, but F32 x [2] takes 8"),
    ({"a": _t("F4", (3,), (0, 2))}, 2, "a", "12 bits, not a whole number of bytes"),
    ({"a": _t(), "b": _t(offsets=(4, 12))}, 12, "b", "overlap tensor 'a'"),
    ({"a": _t(), "b": _t(offsets=(0, 8))}, 8, "b", "overlap tensor 'a'"),
    ({"a": _t(offsets=(4, 12))}, 12, "a", "bytes 0..4 before it belong to no tensor"),
    ({"a": _t()}, 12, None, "4 bytes after the last tensor belong to no tensor"),
    ({"__metadata__": {"format": 1}, "a": _t()}, 8, None, "__metadata__ is not an object of strings"),
    ({"__metadata__": ["pt"], "a": _t()}, 8, None, "__metadata__ is not an object of strings"),
])
def test_each_malformed_field_is_one_named_error(tmp_path, header, data, tensor, problem):
    folder = _model(tmp_path, header, data)
    with pytest.raises(SourceCheckpointError) as info:
        check_source(folder)
    message = str(info.value).splitlines()[0]
    assert str(folder / SINGLE) in message and problem in message, message
    assert tensor is None or f"tensor {tensor!r}" in message
    assert info.value.fix == FIX


@pytest.mark.parametrize("raw", [
    b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    b"[" * 1_000_000,
    b'{"a": {"dtype": "F32", "shape": [[[[[[2]]]]]], "data_offsets": [0, 8]}}',
    b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"x": {"y": {"z": 1}}}}',
])
def test_deep_nesting_never_reaches_the_recursion_limit(tmp_path, raw):
    with pytest.raises(SourceCheckpointError, match="nests deeper than 3 levels|do not balance") as info:
        check_source(_model(tmp_path, raw, 8))
    assert info.value.fix == FIX


@pytest.mark.parametrize("raw, problem", [
    (b"\xff\xfe{}", "not JSON"), (b"{'a': 1}", "not JSON"), (b"", "not JSON"), (b"NaN", "not an object"),
    (b'{"a": ' + b"9" * 5000 + b"}", "not JSON"),
])
def test_unparseable_headers_are_one_named_error(tmp_path, raw, problem):
    with pytest.raises(SourceCheckpointError, match=problem):
        check_source(_model(tmp_path, raw, 0))


def test_truncation_and_oversized_headers_keep_their_own_errors(tmp_path):
    folder = _model(tmp_path, {"a": _t()}, 4)
    with pytest.raises(SourceCheckpointError, match="is truncated: its tensors need 8 bytes") as info:
        check_source(folder)
    assert "download" in info.value.fix
    (folder / SINGLE).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SourceCheckpointError, match="truncated or not safetensors"):
        check_source(folder)


@pytest.mark.parametrize("index", [[1, 2], {"weight_map": ["a"]}, {"weight_map": {"a": 3}},
                                   {"weight_map": {"a": None}}, {"metadata": {}}, "[" * 10000])
def test_a_malformed_index_is_one_named_error(tmp_path, index):
    folder = _model(tmp_path, {"a": _t()}, 8)
    (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(SourceCheckpointError, match="model.safetensors.index.json"):
        check_source(folder)


def test_the_launcher_refuses_a_malformed_header_with_exit_2_before_verify(fixture_dir, tmp_path, monkeypatch):
    from entrypoint.launcher.preflight import FinetuneError, prepare

    model = tmp_path / "model"
    shutil.copytree(fixture_dir.model_dir, model)
    write_safetensors(model / SINGLE, {"model.embed_tokens.weight": {"dtype": "F32", "shape": [2],
                                                                      "data_offsets": [0, 8, 9]}}, 8)
    monkeypatch.chdir(tmp_path)

    def gate(**_):
        raise AssertionError("verify ran on a model with a malformed header")

    with pytest.raises(FinetuneError) as info:
        prepare(config_file=str(fixture_dir.config), overrides=[f"model.path={model}", f"output.dir={tmp_path / 'o'}"],
                allow_fallback=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, log=lambda m: None,
                gate=gate)
    assert info.value.exit_code == 2 and "tensor 'model.embed_tokens.weight'" in str(info.value)
    assert info.value.fix == FIX
