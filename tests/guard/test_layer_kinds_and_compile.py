"""Two ways round the guard, closed at the root. A layer kind that ran is judged by what ran inside
it, not by whether the functions the guard wraps were called: a trainer that rebinds them (or the
layer's forward) after the guard attached is refused, naming what they are bound to now. A
training forward under torch.compile, which the guard cannot see into, is refused by name, or
with FTIMAGE_GUARD_ALLOW_COMPILE=1 runs, logged, and the report says the guard was silent."""
from __future__ import annotations

import pytest

from tests.guard.test_trl import assert_one_clean_refusal, refusals

pytestmark = pytest.mark.training

TORCH_REFERENCES = ["causal_conv1d_fn", "torch_chunk_gated_delta_rule"]
UNWRAPPED = "transformers.models.qwen3_5.modeling_qwen3_5.{} (transformers' torch reference itself, unwrapped)"


def test_rebinding_the_fused_functions_to_their_torch_references_is_refused_naming_the_layer_kind(scenario):
    # packed rows without seq_idx/cu_seqlens: refused when the layer calls the names the guard wrapped
    # (test_trl.test_the_same_violation_inside_the_window_is_refused), and now when it calls them no more
    run = scenario(trainer="loop", kernels="fused", attention="fa2", steps=2, break_at=1, rebind=TORCH_REFERENCES)
    assert_one_clean_refusal(run)
    line = refusals(run.stderr)[0]
    assert "training step 1" in line
    assert "linear_attention (Qwen3_5GatedDeltaNet) ran 2 time(s) without a complete fused path " \
           "(causal_conv1d_fn + chunk_gated_delta_rule)" in line
    assert f"causal_conv1d_fn is now {UNWRAPPED.format('causal_conv1d_fn')}" in line
    assert f"torch_chunk_gated_delta_rule is now {UNWRAPPED.format('torch_chunk_gated_delta_rule')}" in line
    assert "remove the code that rebinds them" in run.stderr
    report = run.report()
    assert [v["function"] for v in report["violations"]] == ["linear_attention"]
    gdn = report["layers"]["linear_attention"]
    assert gdn["verdict"] == "refused" and gdn["forward"] == 2 and gdn["paths_ran"] == {"no complete path": 2}
    assert set(gdn["rebound"]) == set(TORCH_REFERENCES)
    assert report["functions"]["causal_conv1d_fn"]["verdict"] == "not run while its layer ran"
    assert report["layers"]["full_attention"]["verdict"] == "pass"


def test_the_same_rebinding_with_a_block_diagonal_mask_and_the_fallback_override_is_refused(scenario):
    # sdpa with use_cache=False: transformers builds a block-diagonal mask from the packed position_ids,
    # which the override lets through for the attention; it never lets a layer kind run unseen
    run = scenario(trainer="loop", kernels="fused", attention="sdpa", steps=2, break_at=1, rebind=TORCH_REFERENCES,
                   env={"FTIMAGE_ALLOW_FALLBACK": "1"})
    assert_one_clean_refusal(run)
    assert "its mask keeps the packed documents apart" in run.stderr       # the override, logged
    assert "linear_attention (Qwen3_5GatedDeltaNet) ran 2 time(s)" in refusals(run.stderr)[0]
    report = run.report()
    assert report["status"] == "refused" and [v["function"] for v in report["violations"]] == ["linear_attention"]
    assert report["layers"]["full_attention"]["verdict"] == "pass"
    assert report["functions"]["attention"]["verdict"] == "fallback allowed"


def test_rebinding_the_layer_classes_forward_is_refused_naming_what_runs_instead(scenario):
    run = scenario(trainer="loop", kernels="fused", attention="fa2", steps=2,
                   rebind=["Qwen3_5GatedDeltaNet.forward"])
    assert_one_clean_refusal(run)
    line = refusals(run.stderr)[0]
    assert "linear_attention: the model holds 2 Qwen3_5GatedDeltaNet layer(s), but none ran through " \
           "Qwen3_5GatedDeltaNet.forward in this training step" in line
    assert "Qwen3_5GatedDeltaNet.forward is now transformers.models.qwen3_5.modeling_qwen3_5." \
           "Qwen3_5GatedDeltaNet.forward" in line


def test_a_pass_names_the_path_each_layer_kind_ran_and_never_not_run(scenario):
    run = scenario(trainer="loop", kernels="fused", attention="fa2", steps=3)
    assert run.rc == 0 and "STEP 3" in run.stdout, run.stderr[-4000:]
    [summary] = [line for line in run.stderr.splitlines() if line.startswith("ftimage-guard: pass:")]
    assert "linear_attention (Qwen3_5GatedDeltaNet): pass, ran 4 time(s), path causal_conv1d_fn + " \
           "chunk_gated_delta_rule (4)" in summary
    assert "full_attention (Qwen3_5Attention): pass, ran 4 time(s), path the attention function" in summary
    assert "not run" not in summary
    layers = run.report()["layers"]
    assert layers["linear_attention"]["present"] == 2 and layers["full_attention"]["forward"] == 4


def test_a_compiled_model_is_refused_naming_torch_compile_and_the_report_is_written(scenario):
    # refused at its first forward: the graph break at the model's forward comes before any layer
    run = scenario(trainer="loop", kernels="none", attention="sdpa", steps=2, break_at=1, compile="aot_eager")
    assert_one_clean_refusal(run)
    line = refusals(run.stderr)[0]
    assert "training step 1" in line and "Qwen3_5ForCausalLM.forward (the family's model) ran under torch.compile" \
        in line
    assert "FTIMAGE_GUARD_ALLOW_COMPILE=1" in run.stderr and "STEP 1" not in run.stdout
    report = run.report()
    assert report["status"] == "refused" and [v["function"] for v in report["violations"]] == ["torch.compile"]
    assert report["compiled"]["training_forwards"] == 1 and not report["compiled"]["allowed"]


def test_a_compiled_model_with_the_override_trains_and_the_report_says_the_guard_was_silent(scenario):
    # one step: compiling the tiny model takes most of this test's time on CPU
    run = scenario(trainer="loop", kernels="none", attention="sdpa", steps=1, break_at=1, compile="aot_eager",
                   env={"FTIMAGE_GUARD_ALLOW_COMPILE": "1"})
    assert run.rc == 0 and "TRAINED" in run.stdout, run.stderr[-4000:]
    logged = [line for line in run.stderr.splitlines() if line.startswith("ftimage-guard")]
    assert len(logged) == 1 and logged[0].startswith("ftimage-guard: override: FTIMAGE_GUARD_ALLOW_COMPILE=1: "), logged
    report = run.report()                 # written at exit: the window never ended
    assert report["status"] == "silent" and "torch.compile" in report["silent"]
    assert report["overrides"] == [logged[0].removeprefix("ftimage-guard: override: ")]
    assert report["compiled"]["allowed"] and report["compiled"]["training_forwards"] == 1
    assert report["window"]["checked"] == 0 and not report["violations"]
    for entry in report["layers"].values():
        assert entry["verdict"] == "silent: compiled" and entry["compiled"] > 0


def test_a_malformed_compile_override_is_one_error_and_exit_2(scenario):
    bad = scenario(trainer="import", env={"FTIMAGE_GUARD_ALLOW_COMPILE": "sure"})
    assert bad.rc == 2 and "Traceback" not in bad.stderr and "ACTIVE" not in bad.stdout
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert lines[-2] == "error: ftimage-guard: FTIMAGE_GUARD_ALLOW_COMPILE='sure' is neither 1 nor 0", bad.stderr
    assert lines[-1].startswith("  fix: set FTIMAGE_GUARD_ALLOW_COMPILE=1")
