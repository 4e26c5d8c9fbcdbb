"""TRL's real SFTTrainer on two ranks with a Mamba2 hybrid (Granite 4.0-H) and an MoE hybrid
(Qwen3.5-MoE): packed without the boundary kwargs their kernels take, the guard refuses the run
naming the family, the layer kind and the function; packed with them and the CPU test doubles of
the kernels, it trains, and the guard counts fused forward and backward calls."""
from __future__ import annotations

import pytest

from tests.guard.test_trl import refusals, reports, torchrun

pytestmark = pytest.mark.training

# TRL 1.16 computes the MoE load-balancing loss with text_config.num_experts, which Granite's config
# calls num_local_experts (AttributeError at the first step); a Granite run turns that loss off.
SFT_ARGS = {"granitemoehybrid": {"router_aux_loss_coef": 0.0}}
CASES = {
    # family: (a fused function its layer kind calls in training, its kernel's autograd Function, layer kind)
    "granitemoehybrid": ("mamba_split_conv1d_scan_combined", "mamba_ssm.ops.triton.ssd_combined",
                         "linear_attention", "seq_idx"),
    "qwen3_5_moe": ("chunk_gated_delta_rule", "fla.ops.gated_delta_rule", "linear_attention", "cu_seqlens"),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_packed_without_boundaries_is_refused_naming_family_kind_and_function(venv_python, tokenizer_dir, tmp_path,
                                                                              family):
    function, _, kind, kwarg = CASES[family]
    spec = {"family": family, "kernels": "fused", "attention": "fa2", "batches": "position_ids",
            "tokenizer": tokenizer_dir, "sft_args": SFT_ARGS.get(family, {})}
    proc = torchrun(venv_python, spec, tmp_path, timeout=420)
    assert proc.returncode != 0 and "TRAINED" not in proc.stdout, proc.stderr[-4000:]
    lines = refusals(proc.stderr)
    assert len(lines) == 2, proc.stderr[-4000:]
    for line in lines:
        assert f"model family {family}" in line and f"({kind} layers)" in line, line
    assert f"packed batch without {kwarg} reached" in proc.stderr
    for report in reports(tmp_path):
        assert report["status"] == "refused" and report["family"] == family
        assert function in {v["function"] for v in report["violations"]}


@pytest.mark.parametrize("family", sorted(CASES))
def test_packed_with_boundaries_and_the_kernels_trains_on_the_fused_path(venv_python, tokenizer_dir, tmp_path, family):
    function, kernel_module, _, _ = CASES[family]
    spec = {"family": family, "kernels": "fused", "attention": "fa2", "batches": "packed", "steps": 3,
            "tokenizer": tokenizer_dir, "sft_args": SFT_ARGS.get(family, {})}
    proc = torchrun(venv_python, spec, tmp_path, timeout=420)
    assert proc.returncode == 0 and proc.stdout.count("TRAINED") == 2, proc.stderr[-4000:]
    for report in reports(tmp_path):
        assert report["status"] == "pass" and not report["violations"], report["violations"]
        entry = report["functions"][function]
        assert entry["verdict"] == "pass" and entry["forward"]["fused"] > 0 and entry["forward"]["torch"] == 0
        assert entry["backward"]["fused"] > 0 and entry["backward"]["torch"] == 0
        assert all(name.startswith(kernel_module) for name in entry["ran_backward"]), entry["ran_backward"]
        assert entry["boundaries_present"] == entry["packed_calls"] > 0
        # both families are MoE: the experts ran their grouped path, forward and backward
        experts = report["experts"]
        assert set(experts["training"]) == {"grouped_mm"} and set(experts["backward"]) == {"grouped_mm"}, experts
