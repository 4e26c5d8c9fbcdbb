"""guard.experts_watch on its own, on a tiny Qwen3.5-MoE text model (2 layers, 4 experts) on CPU:
it counts each training call of the experts by the implementation that ran, forward and backward,
and a per-expert fallback in training (forced: the fallback op, or the eager loop) is a violation
naming the family, the class and the reason; eval forwards are counted apart and never judged;
uninstall leaves transformers as it was; its reasons are verify's, word for word."""
from __future__ import annotations

import pytest
import torch
from packaging import version
from transformers.integrations import moe
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

from families import Experts
from guard.experts_watch import ExpertsWatch
from tests.verify.test_experts_path import misalign, tiny_moe

pytestmark = pytest.mark.unit
IDS = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def watch():
    """Install a watch for the family's experts; uninstalled after the test, before monkeypatch undoes."""
    made = []

    def make(layer_class: str = "Qwen3_5MoeExperts") -> ExpertsWatch:
        w = ExpertsWatch("qwen3_5_moe", Experts(layer_class=layer_class), modeling)
        made.append(w)
        assert w.install() == []
        return w
    yield make
    for w in reversed(made):
        w.uninstall()


def train_step(model) -> None:
    model.train()
    model(input_ids=IDS, use_cache=False).logits.float().pow(2).mean().backward()


def test_the_grouped_path_in_training_is_counted_forward_and_backward_and_passes(watch):
    w = watch()
    train_step(tiny_moe())
    assert w.training == {"grouped_mm": 2} and w.backward == {"grouped_mm": 2} and not w.eval
    assert w.judge() == (None, "") and w.violation() is None
    assert w.to_dict() == {"layer_class": "Qwen3_5MoeExperts", "wanted": "grouped_mm", "configured": ["grouped_mm"],
                           "training": {"grouped_mm": 2}, "eval": {}, "backward": {"grouped_mm": 2}, "reasons": []}


def test_the_fallback_op_in_training_is_a_violation_naming_family_class_and_reason(watch, monkeypatch):
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda input, weight, offs: False)
    w = watch()
    model = tiny_moe()
    train_step(model)
    assert w.training == {"grouped_mm_fallback": 2} and w.backward == {"grouped_mm_fallback": 2}
    found = w.violation()
    assert found.function == "experts"
    assert found.message.startswith("experts (Qwen3_5MoeExperts, family qwen3_5_moe): a training step ran grouped_mm's "
                                    "per-expert fallback op torch.ops.transformers.grouped_mm_fallback, because "
                                    "transformers' _can_use_grouped_mm said no, yet none of the conditions")
    assert found.message.endswith("not grouped_mm: one small matmul per expert, forward and backward")
    assert found.fix == ("leave transformers.integrations.moe._can_use_grouped_mm as transformers defines it",)
    train_step(model)                       # the same fallback again: the same words, so the guard keeps it once
    assert w.violation() == found and w.training == {"grouped_mm_fallback": 4}
    violation, override = w.judge(allow_fallback=True)
    assert violation is None and override == f"FTIMAGE_ALLOW_FALLBACK=1: {found.message}; allowed, logged"


def test_unaligned_weights_name_their_alignment(watch, monkeypatch):
    model = tiny_moe()
    for layer in model.modules():
        if type(layer).__name__ == "Qwen3_5MoeExperts":
            layer.down_proj.data = misalign(layer.down_proj.data)
    monkeypatch.setattr(moe, "is_torch_less_or_equal",
                        lambda v, accept_dev=False: version.parse("2.10.0") <= version.parse(v))
    w = watch()
    train_step(model)
    assert w.training == {"grouped_mm_fallback": 2}
    assert w.backward == {"grouped_mm_fallback": 2, "grouped_mm": 2}
    assert "runs grouped_mm only on 16-byte aligned tensors, and weight (data_ptr % 16 = 4)" in w.violation().message


def test_the_eager_loop_in_training_is_a_violation_with_the_load_fix(watch):
    w = watch()
    train_step(tiny_moe(experts_implementation="eager"))
    assert w.training == {"eager": 2} and w.backward == {"eager": 2}
    found = w.violation()
    assert "ran transformers' per-expert eager loop (config experts_implementation: eager;" in found.message
    assert 'experts_implementation="grouped_mm"' in found.fix[0]


def test_eval_forwards_are_counted_apart_and_never_judged(watch, monkeypatch):
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda input, weight, offs: False)
    w = watch()
    model = tiny_moe().eval()
    with torch.no_grad():
        model(input_ids=IDS, use_cache=False)
    assert w.eval == {"grouped_mm_fallback": 2} and not w.training and w.judge() == (None, "")
    assert w.reasons == {}


def test_uninstall_leaves_transformers_as_it_was_and_counts_nothing_more(watch):
    original_can_use = moe._can_use_grouped_mm
    w = watch()
    assert "get_interface" in moe.ALL_EXPERTS_FUNCTIONS.__dict__ and moe._can_use_grouped_mm is not original_can_use
    w.uninstall()
    assert "get_interface" not in moe.ALL_EXPERTS_FUNCTIONS.__dict__ and moe._can_use_grouped_mm is original_can_use
    train_step(tiny_moe())
    assert not w.training and not w.backward


def test_a_class_the_modeling_module_lacks_is_a_setup_problem():
    problems = ExpertsWatch("qwen3_5_moe", Experts(layer_class="NoSuchExperts"), modeling).install()
    assert [p.function for p in problems] == ["experts"] and "has no NoSuchExperts" in problems[0].message
    assert "get_interface" not in moe.ALL_EXPERTS_FUNCTIONS.__dict__
