"""model_fit: a model outside what the image's kernels were compiled for is refused, on CPU,
before any rank starts."""
from __future__ import annotations

import json

import pytest

from contracts.lock import Specialisation
from families import load_family
from tests.fixtures.locks import environment_lock, manifest_kernel
from verify.checks import model_fit
from verify.context import Context
from verify.report import Status

pytestmark = pytest.mark.unit
FAMILY = load_family("qwen3_5_text")
QWEN = Specialisation(head_dims=(256,), dtypes=("bf16",), family="qwen3_5_text",
                      disabled=("dropout", "alibi", "softcap", "sliding_window", "uneven_head_dim"))
QWEN_CONV = Specialisation(dtypes=("bf16",), family="qwen3_5_text")


def qwen_lock():
    return environment_lock(attn_implementation="flash_attention_2", target_archs=("sm_90",), kernels=(
        manifest_kernel("flash-attn", specialisation=QWEN), manifest_kernel("causal-conv1d", specialisation=QWEN_CONV)))


def model_dir(tmp_path, **config):
    base = {"model_type": "qwen3_5_text", "head_dim": 256, "hidden_size": 2048, "num_attention_heads": 16,
            "attention_dropout": 0.0}
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return tmp_path


def run(tmp_path=None, param_dtype="bfloat16", **config):
    cfg = model_fit.read_model_config(model_dir(tmp_path, **config)) if tmp_path else None
    ctx = Context(lock=qwen_lock(), device="cpu", family=FAMILY, model_config=cfg, model_source="m/config.json",
                  param_dtype=param_dtype)
    return {r.check: r for r in model_fit.run(ctx)}


def test_a_model_that_fits_passes(tmp_path):
    rows = run(tmp_path)
    assert {r.status for r in rows.values()} == {Status.PASS}, rows
    assert set(rows) == {"model_fit.head_dim", "model_fit.dtype.flash-attn", "model_fit.features",
                         "model_fit.dtype.causal-conv1d"}


@pytest.mark.parametrize("config, row, words", [
    ({"head_dim": 128}, "model_fit.head_dim", "attention head dim 128"),
    ({"attention_dropout": 0.1}, "model_fit.features", "attention_dropout 0.1"),
    ({"sliding_window": 4096, "use_sliding_window": True}, "model_fit.features", "sliding window 4096"),
    ({"attn_logit_softcapping": 50.0}, "model_fit.features", "softcap 50.0"),
])
def test_a_model_outside_the_specialisation_is_refused(tmp_path, config, row, words):
    rows = run(tmp_path, **config)
    assert rows[row].status is Status.FAIL and words in rows[row].detail, rows[row].detail
    assert "specialise_kernels: false" in rows[row].fix


def test_fp16_params_on_a_bf16_build_are_refused_for_every_kernel():
    rows = run(param_dtype="float16")
    for kernel in ("flash-attn", "causal-conv1d"):
        row = rows[f"model_fit.dtype.{kernel}"]
        assert row.status is Status.FAIL and "float16" in row.detail and "bfloat16" in row.fix


def test_nested_text_config_and_missing_config_are_handled(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"head_dim": 128}}))
    assert model_fit.read_model_config(tmp_path)["head_dim"] == 128
    with pytest.raises(model_fit.ModelConfigError, match="does not exist"):
        model_fit.read_model_config(tmp_path / "nope")


def test_generic_builds_and_kernel_free_images_are_not_refused():
    ctx = Context(lock=environment_lock(), device="cpu", family=FAMILY)
    (row,) = model_fit.run(ctx)
    assert row.status is Status.SKIP


def test_verify_cli_refuses_a_mounted_model_outside_the_build(tmp_path, run_verify, rows_by_check):
    lock = tmp_path / "lock.json"
    lock.write_text(qwen_lock().to_json())
    code, out, err = run_verify("--checks", "model_fit", "--device", "cpu", "--json", "--lock", str(lock),
                                "--model", str(model_dir(tmp_path, head_dim=128)))
    assert code == 2, err
    assert rows_by_check(out)["model_fit.head_dim"]["status"] == "FAIL"
