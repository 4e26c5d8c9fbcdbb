"""verify.experts_path on a tiny Qwen3.5-MoE text model (2 layers, 4 experts) on CPU: the grouped
path passes only when it ran forward and backward; a per-expert fallback is forced (transformers'
own test replaced, or a real condition: unaligned weights on a torch that needs them aligned) and
FAILs with its reason; eager picked silently at load is named as such; and the reason function
agrees with transformers' `_can_use_grouped_mm` on every combination of the facts it tests."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from packaging import version
from transformers.integrations import moe
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

from verify import experts_path
from verify.report import Status

pytestmark = pytest.mark.unit
EXPERTS = "Qwen3_5MoeExperts"


def tiny_moe(**extra):
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], **extra)
    torch.manual_seed(0)
    return modeling.Qwen3_5MoeForCausalLM(config)


@pytest.fixture(scope="module")
def model():
    return tiny_moe()


def misalign(t: torch.Tensor) -> torch.Tensor:
    """The same values 4 bytes past a 16-byte boundary, as a memory-mapped file can leave them."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
    moved = buffer[1:].view(t.shape)
    moved.copy_(t)
    return moved


def test_grouped_mm_forward_and_backward_passes_and_leaves_the_model_as_it_was(model):
    run = experts_path.record_experts_path(model, EXPERTS)
    assert (run.modules, run.configured, run.error) == (2, ("grouped_mm",), "")
    assert run.forward == {"grouped_mm": 2} and run.backward == {"grouped_mm": 2}
    row = experts_path.decide_experts("qwen3_5_moe", run, "cpu")
    assert row.check == "experts.qwen3_5_moe" and row.status is Status.PASS, row.detail
    assert all(p.grad is None for p in model.parameters())      # autograd.grad, not .backward()


def test_the_fallback_op_forced_by_a_replaced_test_fails_on_cpu_naming_why(model, monkeypatch):
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda input, weight, offs: False)
    run = experts_path.record_experts_path(model, EXPERTS)
    assert run.configured == ("grouped_mm",)          # the config still says grouped_mm
    assert run.forward == {"grouped_mm_fallback": 2} and run.backward == {"grouped_mm_fallback": 2}
    row = experts_path.decide_experts("qwen3_5_moe", run, "cpu")
    assert row.status is Status.FAIL
    assert "took its per-expert fallback op (torch.ops.transformers.grouped_mm_fallback" in row.detail
    assert "none of the conditions it tests in transformers 5.18 holds here" in row.detail
    assert "not transformers' own" in row.detail and "runs grouped_mm on CPU" in row.detail
    assert "leave transformers.integrations.moe._can_use_grouped_mm as transformers defines it" in row.fix
    allowed = experts_path.decide_experts("qwen3_5_moe", run, "cpu", allow_fallback=True)
    assert allowed.status is Status.WARN and allowed.detail.startswith("FTIMAGE_ALLOW_FALLBACK=1: ")
    on_gpu = experts_path.decide_experts("qwen3_5_moe", run, "cuda:0", allow_fallback=True)
    assert on_gpu.status is Status.FAIL and "allows the per-expert fallback on CPU only, not on cuda" in on_gpu.detail


def test_unaligned_weights_on_a_torch_that_needs_alignment_take_the_fallback_for_that_reason(monkeypatch):
    model = tiny_moe()
    for layer in model.modules():
        if type(layer).__name__ == EXPERTS:
            layer.gate_up_proj.data = misalign(layer.gate_up_proj.data)
    # transformers' own _can_use_grouped_mm, on a torch it takes for 2.10 (which needs 16-byte alignment)
    monkeypatch.setattr(moe, "is_torch_less_or_equal",
                        lambda v, accept_dev=False: version.parse("2.10.0") <= version.parse(v))
    run = experts_path.record_experts_path(model, EXPERTS)
    # the up projection falls back, the down projection (aligned) does not: both backward nodes ran
    assert run.forward == {"grouped_mm_fallback": 2}
    assert run.backward == {"grouped_mm_fallback": 2, "grouped_mm": 2}
    assert run.reasons == (f"on CPU, torch {torch.__version__} (<= 2.10) runs grouped_mm only on 16-byte aligned "
                           "tensors, and weight (data_ptr % 16 = 4) is not (memory-mapped safetensors weights can be "
                           "unaligned)",)
    row = experts_path.decide_experts("qwen3_5_moe", run, "cpu")
    assert row.status is Status.FAIL and "16-byte aligned" in row.detail
    assert "load the weights without memory-mapping them" in row.fix


def test_eager_picked_silently_at_load_is_named_as_such(monkeypatch):
    # what transformers does when it cannot read the modeling source (a notebook class, a stripped file)
    for cls in (modeling.Qwen3_5MoeForCausalLM, modeling.Qwen3_5MoeTextModel):
        monkeypatch.setattr(cls, "_can_set_experts_implementation_cached_value", False, raising=False)
    run = experts_path.record_experts_path(tiny_moe(), EXPERTS)
    assert run.configured == ("eager",) and run.forward == {"eager": 2} and run.backward == {"eager": 2}
    assert run.load_reason.startswith("transformers picked eager at load: Qwen3_5MoeForCausalLM._grouped_mm_can_"
                                      "dispatch() raises ValueError: Qwen3_5MoeForCausalLM does not support setting "
                                      "experts implementation.")
    row = experts_path.decide_experts("qwen3_5_moe", run, "cuda")
    assert row.status is Status.FAIL and "per-expert eager loop ran (transformers picked eager at load" in row.detail
    assert 'experts_implementation="grouped_mm"' in row.fix


def test_eager_asked_for_is_named_as_asked_for():
    run = experts_path.record_experts_path(tiny_moe(experts_implementation="eager"), EXPERTS)
    assert run.forward == {"eager": 2} and run.load_reason.startswith("experts_implementation='eager' was requested")
    assert experts_path.decide_experts("qwen3_5_moe", run, "cpu", allow_fallback=True).status is Status.WARN


def test_another_implementation_than_the_wanted_one_fails_even_with_the_override():
    run = experts_path.record_experts_path(tiny_moe(experts_implementation="batched_mm"), EXPERTS)
    assert run.forward == {"batched_mm": 2} and run.backward == {"batched_mm": 2}
    row = experts_path.decide_experts("qwen3_5_moe", run, "cpu", allow_fallback=True)
    assert row.status is Status.FAIL and "batched_mm ran, not grouped_mm" in row.detail


def test_a_step_that_did_not_run_or_a_class_the_model_lacks_fails(model):
    missing = experts_path.record_experts_path(model, "NoSuchExperts")
    row = experts_path.decide_experts("qwen3_5_moe", missing, "cpu")
    assert row.status is Status.FAIL and "holds no NoSuchExperts layer" in row.detail
    silent = experts_path.ExpertsRun(EXPERTS, "grouped_mm", "cpu", modules=2, configured=("grouped_mm",))
    assert "no Qwen3_5MoeExperts call ran" in experts_path.decide_experts("qwen3_5_moe", silent, "cpu").detail
    forward_only = experts_path.ExpertsRun(EXPERTS, "grouped_mm", "cuda", modules=2, forward={"grouped_mm": 2})
    assert experts_path.decide_experts("q", forward_only, "cuda").status is Status.FAIL



def test_the_row_for_a_family_with_experts_and_none_for_one_without(model):
    from families import Experts

    family = SimpleNamespace(name="qwen3_5_moe", experts=Experts(layer_class=EXPERTS))
    assert experts_path.experts_row(family, model, "cpu").status is Status.PASS
    assert experts_path.experts_row(SimpleNamespace(name="dense", experts=None), model, "cpu") is None

# -- the reason, against transformers' own test ------------------------------------------------------------
FACTS = list(itertools.product(
    ("cpu", "cuda", "tpu"), (torch.float32, torch.bfloat16), (False, True),   # device, dtype, compiling
    ("2.13", "2.10", "2.8"), (True, False), ((7, 5), (8, 0), (9, 0)),        # torch, aligned, capability
    (True, False), (True, False)))                                           # has F.grouped_mm / torch._grouped_mm


def pretend(m, torch_version: str, compiling: bool, capability, functional: bool, private: bool) -> None:
    """Make transformers' predicates (and torch's attributes) say these facts."""
    m.setattr(moe, "is_torch_less_or_equal",
              lambda v, accept_dev=False: version.parse(torch_version) <= version.parse(v))
    m.setattr(moe, "is_torch_greater_or_equal",
              lambda v, accept_dev=False: version.parse(torch_version) >= version.parse(v))
    m.setattr(moe, "is_torchdynamo_compiling", lambda: compiling)
    m.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if not functional:
        m.delattr(F, "grouped_mm")
    if not private:
        m.delattr(torch, "_grouped_mm")


def fake(kind: str, dtype, aligned: bool):
    """What _can_use_grouped_mm reads of a tensor: its device type, dtype and address."""
    return SimpleNamespace(device=SimpleNamespace(type=kind), dtype=dtype, data_ptr=lambda: 0 if aligned else 4)


def test_the_reason_is_empty_exactly_when_transformers_would_use_grouped_mm(monkeypatch):
    disagree = []
    for kind, dtype, compiling, torch_version, aligned, capability, functional, private in FACTS:
        with monkeypatch.context() as m:
            pretend(m, torch_version, compiling, capability, functional, private)
            input, weight = fake(kind, dtype, True), fake(kind, dtype, aligned)
            transformers_says = moe._can_use_grouped_mm(input, weight, None)
            reason, fix = experts_path.why_not_grouped(weight.device, dtype, input, weight)
        if transformers_says == bool(reason) or (reason and not fix):
            disagree.append((kind, dtype, compiling, torch_version, aligned, capability, functional, private, reason))
    assert not disagree, disagree[:5]


@pytest.mark.parametrize(("facts", "words"), [
    (("cpu", torch.float32, True, "2.13", True, (9, 0), True, True), "under torch.compile grouped_mm takes only bf"),
    (("cpu", torch.float32, False, "2.10", False, (9, 0), True, True), "weight (data_ptr % 16 = 4) is not"),
    (("cpu", torch.float32, False, "2.8", True, (9, 0), True, True), "(<= 2.8) has no CPU kernel for grouped_mm"),
    (("cuda", torch.bfloat16, False, "2.13", True, (7, 5), True, True), "and this GPU is sm_75"),
    (("cuda", torch.bfloat16, False, "2.8", True, (8, 0), False, True), "which runs on Hopper (sm_90) alone"),
    (("tpu", torch.bfloat16, False, "2.8", True, (8, 0), False, False), "has neither torch.nn.functional.grouped_mm"),
])
def test_each_condition_has_its_own_words(monkeypatch, facts, words):
    kind, dtype, compiling, torch_version, aligned, capability, functional, private = facts
    pretend(monkeypatch, torch_version, compiling, capability, functional, private)
    reason = experts_path.fallback_reason(kind, dtype, fake(kind, dtype, True), fake(kind, dtype, aligned))
    assert words in reason
