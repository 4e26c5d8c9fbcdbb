"""The guard inside trainers that are not ours: TRL 1.16's SFTTrainer (and a plain loop) on the
tiny Qwen3.5, CPU, the guard activated through its .pth. Kernels are absent here (the torch
reference is what transformers binds), or replaced by CPU test doubles (tests/guard/kernels)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.training


def refusals(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ftimage-guard")]


def assert_one_clean_refusal(run) -> None:
    assert run.rc == 3, run.stdout[-2000:] + run.stderr[-4000:]
    assert len(refusals(run.stderr)) == 1, run.stderr
    assert "Traceback" not in run.stderr and "TRAINED" not in run.stdout


def test_sdpa_with_packing_is_refused_naming_the_attention(scenario):
    run = scenario(kernels="fused", attention="sdpa", batches="packed")
    assert_one_clean_refusal(run)
    assert "full_attention: sdpa" in refusals(run.stderr)[0]
    assert "flash_attention_2" in run.stderr
    report = run.report()
    assert [v["function"] for v in report["violations"]] == ["attention"]
    assert report["functions"]["causal_conv1d_fn"]["verdict"] == "pass"


def test_a_collator_packing_with_position_ids_only_is_refused_for_conv_and_delta_rule(scenario):
    run = scenario(kernels="fused", attention="fa2", batches="position_ids")
    assert_one_clean_refusal(run)
    assert "packed batch without seq_idx reached causal_conv1d_fn" in run.stderr
    assert "packed batch without cu_seqlens reached torch_chunk_gated_delta_rule" in run.stderr
    assert "DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)" in run.stderr
    report = run.report()
    assert {v["function"] for v in report["violations"]} == {"causal_conv1d_fn", "chunk_gated_delta_rule"}
    # flash-attn derives its boundaries from the packed position_ids (as transformers does)
    assert report["functions"]["attention"]["boundaries_missing"] == 0


def test_padded_batches_with_the_fallback_allowed_train_and_the_report_names_it(scenario):
    run = scenario(kernels="none", attention="sdpa", batches="padded",
                   env={"FTIMAGE_ALLOW_FALLBACK": "1", "FTIMAGE_JSON_LOGS": "1"})
    assert run.rc == 0 and "TRAINED" in run.stdout, run.stderr[-4000:]
    report = run.report()
    json_lines = [json.loads(line) for line in run.stderr.splitlines() if line.startswith('{"')]
    assert [(e["phase"], e["step"]) for e in json_lines] == [("guard", "fallback allowed")]
    assert json_lines[0]["report"] == report
    assert report["status"] == "fallback allowed" and report["window"]["ended"]
    conv = report["functions"]["causal_conv1d_fn"]
    assert conv["verdict"] == "fallback allowed" and conv["fused"] is False
    assert conv["bound"] == "transformers.models.qwen3_5.modeling_qwen3_5.causal_conv1d_fn"
    assert "not installed" in conv["why_torch"] and conv["forward"]["torch"] > 0
    assert report["functions"]["attention"]["verdict"] == "fallback allowed"
    assert report["batches"]["packed"] == 0 and "FTIMAGE_ALLOW_FALLBACK=1" in run.stderr


def test_padded_batches_on_the_torch_path_are_refused_without_the_override(scenario):
    run = scenario(kernels="none", attention="sdpa", batches="padded")
    assert_one_clean_refusal(run)
    assert "FTIMAGE_ALLOW_FALLBACK=1" in run.stderr


def test_a_broken_kernel_import_is_reported_with_its_real_exception(scenario):
    run = scenario(kernels="broken", attention="fa2", batches="packed")
    assert_one_clean_refusal(run)
    line = refusals(run.stderr)[0]
    assert "causal_conv1d_fn: torch reference" in line
    assert "importing causal_conv1d failed: ImportError:" in line
    assert "undefined symbol: _ZN3c104cuda9SetDeviceEa" in line
    assert "installed but broken" in run.stderr
    assert "undefined symbol" in run.report()["functions"]["causal_conv1d_fn"]["why_torch"]


def test_after_the_window_nothing_is_checked(scenario):
    # a no_grad forward first (not a step, not refused), 2 checked steps, boundaries withheld from step 4 on
    run = scenario(trainer="loop", kernels="fused", attention="fa2", steps=5, break_at=4, eval_first=True,
                   env={"FTIMAGE_GUARD_STEPS": "2"})
    assert run.rc == 0 and "STEP 5" in run.stdout, run.stderr[-4000:]
    assert "RESTORED True" in run.stdout           # the layer calls transformers' own wrapper again
    report = run.report()
    assert report["status"] == "pass" and report["window"] == {"steps": 2, "checked": 2, "ended": True}
    assert report["batches"]["eval"] == 1 and report["batches"]["training"] == 2
    assert any("outside training" in w for w in report["warnings"])


def test_the_same_violation_inside_the_window_is_refused(scenario):
    run = scenario(trainer="loop", kernels="fused", attention="fa2", steps=5, break_at=2)
    assert_one_clean_refusal(run)
    assert "training step 2" in refusals(run.stderr)[0] and "STEP 1" in run.stdout


def test_a_refusal_from_backward_on_a_worker_thread_is_one_error_and_exit_3(scenario):
    # reentrant checkpointing runs the first forward without grad, so the kernel's missing autograd
    # Function shows only in the recompute, inside backward, on the training thread
    run = scenario(trainer="loop", kernels="fused", attention="fa2", steps=2, thread=True, checkpointing=True,
                   env={"FTIMAGE_TEST_KERNEL_NO_FUNCTION": "1"})
    assert_one_clean_refusal(run)
    assert "backward is torch autograd ops" in run.stderr or "ran torch autograd ops" in run.stderr
    assert "STEP 1" not in run.stdout


def torchrun(venv_python, spec: dict, workdir, timeout: int = 240):
    import socket
    import subprocess

    from tests.guard.conftest import HERE, REPO, clean_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec["env"] = {"FTIMAGE_GUARD_REPORT": str(workdir / "guard.json"), **spec.get("env", {})}
    cmd = [str(venv_python), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1", "--node-rank",
           "0", "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(HERE / "scenarios.py"), json.dumps(spec), str(workdir)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=clean_env(GLOO_SOCKET_IFNAME="lo", HF_HOME=str(workdir / "home")))


def reports(workdir) -> list[dict]:
    return [json.loads((workdir / name).read_text()) for name in ("guard.json", "guard.rank1.json")]


def test_trl_default_packing_two_ranks_sees_every_boundary_and_refuses_the_torch_fallback(venv_python, tokenizer_dir,
                                                                                          tmp_path):
    proc = torchrun(venv_python, {"kernels": "none", "attention": "sdpa", "batches": "packed",
                                  "tokenizer": tokenizer_dir}, tmp_path)
    assert proc.returncode != 0 and "TRAINED" not in proc.stdout, proc.stderr[-4000:]
    lines = refusals(proc.stderr)
    assert len(lines) == 2, proc.stderr[-4000:]
    assert any("rank 0)" in line for line in lines) and any("rank 1)" in line for line in lines)
    for report in reports(tmp_path):
        assert report["status"] == "refused" and report["batches"]["packed"] >= 1
        assert {"seq_idx", "cu_seq_lens_q", "position_ids"} <= set(report["batches"]["boundary_kwargs"])
        for name in ("causal_conv1d_fn", "chunk_gated_delta_rule", "attention"):
            entry = report["functions"][name]
            # the boundaries reached every layer kind ...
            assert entry["packed_calls"] > 0 and entry["boundaries_missing"] == 0, (name, entry)
            assert entry["verdict"] == "refused" and entry["fused"] is False
        messages = " ".join(v["message"] for v in report["violations"])
        # ... and the torch reference bound for them drops them
        assert "it drops seq_idx" in messages and "it drops cu_seqlens" in messages
        assert "full_attention: sdpa" in messages


def test_trl_packing_two_ranks_with_fused_kernels_passes_with_fused_forward_and_backward(venv_python, tokenizer_dir,
                                                                                        tmp_path):
    proc = torchrun(venv_python, {"kernels": "fused", "attention": "fa2", "batches": "packed", "steps": 3,
                                  "tokenizer": tokenizer_dir}, tmp_path)
    assert proc.returncode == 0 and proc.stdout.count("TRAINED") == 2, proc.stderr[-4000:]
    for report in reports(tmp_path):
        assert report["status"] == "pass" and report["window"] == {"steps": 2, "checked": 2, "ended": True}
        assert not report["violations"]
        for name, kernel in (("causal_conv1d_fn", "causal_conv1d.CausalConv1dFn"),
                             ("chunk_gated_delta_rule", "fla.ops.gated_delta_rule.ChunkGatedDeltaRuleFunction"),
                             ("attention", "flash_attn.FlashAttnVarlenFunc")):
            entry = report["functions"][name]
            assert entry["verdict"] == "pass" and entry["ran_backward"] == [kernel], (name, entry)
            assert entry["forward"]["fused"] > 0 and entry["forward"]["torch"] == 0
            assert entry["backward"]["fused"] > 0 and entry["backward"]["torch"] == 0
            assert entry["boundaries_present"] == entry["packed_calls"] > 0


def test_sdpa_that_really_attends_across_packed_documents_is_named_so(scenario):
    # a loop that leaves use_cache at the model's default: transformers builds a cache and then skips
    # its packed-sequence mask, so sdpa gets no mask at all (the probe notes the same, verify/packing_probe)
    run = scenario(trainer="loop", kernels="fused", attention="sdpa", default_cache=True, steps=2,
                   env={"FTIMAGE_ALLOW_FALLBACK": "1"})       # the override never lets a leak through
    assert_one_clean_refusal(run)
    assert "full_attention: sdpa attends across packed documents (it got no attention mask" in run.stderr
