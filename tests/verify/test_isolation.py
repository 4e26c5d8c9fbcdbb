import math

import pytest
import torch

from families import load_family
from families.qwen3_5_text import prepare_probe_model
from families.runtime import build_model, modeling_module
from verify.checks import isolation
from verify.checks.isolation import TOLERANCES, decide_end_to_end, decide_kind
from verify.context import Context
from verify.packing_probe import max_diff, measure
from verify.report import Status

pytestmark = pytest.mark.unit
FP32 = TOLERANCES["float32"]
FAMILY = load_family("qwen3_5_text")


def probe_model():
    return prepare_probe_model(build_model(FAMILY, "probe", attn_implementation="sdpa"))


@pytest.fixture(scope="module")
def fallback_measurement():
    return measure(probe_model(), modeling_module(FAMILY), FAMILY, device="cpu")


# ---- pure decisions -------------------------------------------------------------------------

def test_kind_decisions():
    assert decide_kind("conv", 1e-7, 0.7, FP32).status is Status.PASS
    leak = decide_kind("conv", 0.7, 0.7, FP32)
    assert leak.status is Status.FAIL and leak.detail.startswith("leak") and "seq_idx" in leak.fix
    blind = decide_kind("gdn", 0.0, 1e-6, FP32)
    assert blind.status is Status.FAIL and blind.detail.startswith("probe blind")
    assert decide_kind("attention", math.nan, math.nan, FP32).status is Status.FAIL


def test_end_to_end_decisions():
    ok = decide_end_to_end(1e-7, 0.8, 1e-7, "w", FP32)
    assert [r.status for r in ok] == [Status.PASS, Status.PASS]
    bad = decide_end_to_end(0.3, 0.8, 0.4, "model.layers.0.linear_attn.conv1d.weight", FP32)
    assert [r.status for r in bad] == [Status.FAIL, Status.FAIL] and "conv1d.weight" in bad[1].detail
    blind = decide_end_to_end(0.0, 0.0, 0.0, "w", FP32)
    assert blind[0].status is Status.FAIL and "probe blind" in blind[0].detail


def test_relative_difference_on_real_tensors():
    ref = torch.tensor([1.0, -2.0, 4.0])
    assert max_diff(ref + torch.tensor([0.0, 0.0, 0.4]), ref) == pytest.approx((0.4, 0.1))
    assert max_diff(torch.zeros(3), torch.zeros(3)) == (0.0, 0.0)


def test_conv_plumbing_note():
    assert "did NOT reach" in isolation.conv_plumbing_note(("activation",), ())
    assert "drops it" in isolation.conv_plumbing_note(("seq_idx",), ("hidden_states", "kwargs"))
    assert "takes it" in isolation.conv_plumbing_note(("seq_idx",), ("x", "seq_idx"))


# ---- the probe on the real tiny model -------------------------------------------------------

def test_torch_fallback_leaks_in_gdn_and_conv_but_not_sdpa(fallback_measurement):
    m = fallback_measurement
    rows = {r.check: r for r in isolation.judge(m, FP32)}
    assert rows["isolation.attention"].status is Status.PASS       # sdpa masks packing (use_cache=False)
    assert rows["isolation.gdn"].status is Status.FAIL and m.packed["gdn"] > 0.1
    assert rows["isolation.conv"].status is Status.FAIL and m.packed["conv"] > 0.1
    assert rows["isolation.logits"].status is Status.FAIL and rows["isolation.grads"].status is Status.FAIL
    # the negative control behaves: every kind changes when boundaries are withheld
    assert all(m.withheld[k] > FP32.blind for k in ("attention", "gdn", "conv"))
    # seq_idx does reach the conv through the model's kwargs in this transformers
    assert "seq_idx" in m.conv_kwargs_seen


def _segments(seq_idx):
    ids = seq_idx[0].tolist()
    spans, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[start]:
            spans.append((start, t))
            start = t
    return spans


def test_boundary_honouring_kernels_pass(monkeypatch):
    """With implementations that honour seq_idx / cu_seqlens the same probe PASSES: it can pass."""
    module = modeling_module(FAMILY)
    conv_ref = module.causal_conv1d_fn.__wrapped__
    gdn_ref = module.torch_chunk_gated_delta_rule.__wrapped__

    def conv(hidden_states, weight, bias=None, activation=None, seq_idx=None, **_):
        if seq_idx is None:
            return conv_ref(hidden_states, weight, bias, activation)
        return torch.cat([conv_ref(hidden_states[..., s:e], weight, bias, activation)
                          for s, e in _segments(seq_idx)], dim=-1)

    def gdn(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
            cu_seqlens=None, **_):
        cuts = [(0, q.shape[1])] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        outs = [gdn_ref(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for s, e in cuts]
        return torch.cat(outs, dim=1), None

    monkeypatch.setattr(module, "causal_conv1d_fn", conv)
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", gdn)
    rows = isolation.judge(measure(probe_model(), module, FAMILY, device="cpu"), FP32)
    assert {r.check: r.status for r in rows} == {f"isolation.{k}": Status.PASS
                                                 for k in ("attention", "gdn", "conv", "logits", "grads")}


def test_a_probe_that_cannot_see_boundaries_fails_as_blind():
    """Zeroed mixer outputs and a conv that only looks at the current token: boundary info cannot
    matter, so the negative control does not move and the check must FAIL, not pass."""
    model = probe_model()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.o_proj.weight.zero_()
            else:
                layer.linear_attn.out_proj.weight.zero_()
                layer.linear_attn.conv1d.weight[..., :-1] = 0
    rows = {r.check: r for r in isolation.judge(measure(model, modeling_module(FAMILY), FAMILY, device="cpu"), FP32)}
    for name in ("isolation.attention", "isolation.conv", "isolation.logits"):
        assert rows[name].status is Status.FAIL and "probe blind" in rows[name].detail, rows[name].detail


def test_isolation_check_on_cpu_reports_each_kind(env_lock):
    rows = {r.check: r for r in isolation.run(Context(lock=env_lock, device="cpu", family=FAMILY))}
    assert set(rows) == {f"isolation.{k}" for k in ("attention", "gdn", "conv", "logits", "grads")}
    assert rows["isolation.conv"].status is Status.FAIL
    assert "seq_idx reached causal_conv1d_fn" in rows["isolation.conv"].detail
    assert rows["isolation.gdn"].data["packed_rel"] > FP32.layer
    assert "attention ran sdpa on cpu" in rows["isolation.attention"].detail


def test_isolation_needs_cuda_when_asked_for_cuda(env_lock):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU-only branch cannot be exercised here")
    rows = isolation.run(Context(lock=env_lock, device="cuda", family=FAMILY))
    assert rows[0].status is Status.FAIL and "needs CUDA" in rows[0].detail


def test_every_row_fails_when_a_kernel_the_probe_ran_is_not_the_image_s_own():
    """What the probe measured through a hook-served function is that code's isolation, not the kernel's."""
    from verify.provenance import Verdict

    rows = decide_end_to_end(1e-7, 0.8, 1e-7, "w", FP32) + [decide_kind("conv", 1e-7, 0.7, FP32)]
    own = Verdict(True, "from causal-conv1d 1.7.0", data={"distribution": "causal-conv1d 1.7.0"})
    served = Verdict(False, "`fla` was served by an import hook: .pth /site/evil.pth", "remove /site/evil.pth")
    kept = isolation.with_provenance(rows, {"causal_conv1d_fn": own})
    assert [r.status for r in kept] == [Status.PASS] * 3 and "causal_conv1d_fn from causal-conv1d 1.7.0" in \
        kept[2].detail
    refused = isolation.with_provenance(rows, {"causal_conv1d_fn": own, "chunk_gated_delta_rule": served})
    assert {r.status for r in refused} == {Status.FAIL} and all("/site/evil.pth" in r.fix for r in refused)
    assert all(r.detail.startswith("not the image's kernels: chunk_gated_delta_rule") for r in refused)
    assert isolation.with_provenance(rows, {}) == rows          # the torch path: nothing fused to vouch for
