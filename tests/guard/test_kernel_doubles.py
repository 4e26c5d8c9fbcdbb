"""The kernel test doubles (tests/guard/kernels/fused/) are only worth their name if they keep
packed documents apart exactly where the real kernels do, and run where transformers would run the
real ones. Per double: a packed row with its boundaries gives the per-document outputs and input
gradients (fp32, 1e-5); the same row without them does not; its backward is its own
autograd.Function (what the guard takes for a kernel), and FTIMAGE_TEST_KERNEL_NO_FUNCTION=1
computes the same without one. And a tiny GraniteMoeHybrid model shows which of them its Mamba2
mixer calls: only mamba_split_conv1d_scan_combined in training without a cache, causal_conv1d_fn +
mamba_chunk_scan_combined in eval.

Everything runs in one child interpreter with fused/ first on sys.path, imported before any
modeling module (that is when transformers binds a kernel), so no double leaks into this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
FUSED = REPO / "tests" / "guard" / "kernels" / "fused"
DOUBLES = ("causal_conv1d_fn", "chunk_gated_delta_rule", "chunk_kda", "mamba_chunk_scan_combined",
           "mamba_split_conv1d_scan_combined", "flash_attention_2")
LENGTHS = (13, 7, 20)          # boundaries inside a 16-token chunk and inside the conv's width
TOL = 1e-5
CHILD = "import runpy, sys; sys.path[:0] = sys.argv[1:3]; runpy.run_path(sys.argv[3], run_name='__main__')"


# -- the child: each double on a packed row -----------------------------------------------------------
def _leaf(*shape, scale=1.0, fn=None):
    import torch

    t = torch.randn(*shape) * scale
    return (fn(t) if fn else t).detach().requires_grad_()


def _cases() -> dict:
    """name -> (call(inputs, spans or None) -> output, inputs, {input with a time axis: its axis}, out axis)."""
    import causal_conv1d
    import flash_attn
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined

    T = sum(LENGTHS)
    seq = lambda spans: None if spans is None else torch.cat(
        [torch.full((b - a,), i, dtype=torch.int32) for i, (a, b) in enumerate(spans)])[None]
    cu = lambda spans, dtype=torch.int32: None if spans is None else torch.tensor(
        [0] + [b for _, b in spans], dtype=dtype)
    neg = lambda t: -F.softplus(t)   # log-space decays
    sig = torch.sigmoid
    return {
        "causal_conv1d_fn": (
            lambda i, s: causal_conv1d.causal_conv1d_fn(i["x"], i["weight"], i["bias"], seq_idx=seq(s),
                                                        activation="silu"),
            {"x": _leaf(1, 8, T), "weight": _leaf(8, 4), "bias": _leaf(8)}, {"x": 2}, 2),
        "chunk_gated_delta_rule": (
            lambda i, s: chunk_gated_delta_rule(i["q"], i["k"], i["v"], i["g"], i["beta"], cu_seqlens=cu(s),
                                                use_qk_l2norm_in_kernel=True)[0],
            {"q": _leaf(1, T, 2, 16), "k": _leaf(1, T, 2, 16), "v": _leaf(1, T, 2, 16),
             "g": _leaf(1, T, 2, fn=neg), "beta": _leaf(1, T, 2, fn=sig)},
            {"q": 1, "k": 1, "v": 1, "g": 1, "beta": 1}, 1),
        "chunk_kda": (
            lambda i, s: chunk_kda(i["q"], i["k"], i["v"], g=i["g"], beta=i["beta"], cu_seqlens=cu(s, torch.long),
                                   use_qk_l2norm_in_kernel=True)[0],
            {"q": _leaf(1, T, 2, 16), "k": _leaf(1, T, 2, 16), "v": _leaf(1, T, 2, 16),
             "g": _leaf(1, T, 2, 16, fn=neg), "beta": _leaf(1, T, 2, fn=sig)},
            {"q": 1, "k": 1, "v": 1, "g": 1, "beta": 1}, 1),
        "mamba_chunk_scan_combined": (
            lambda i, s: mamba_chunk_scan_combined(i["x"], i["dt"], i["A"], i["B"], i["C"], 16, D=i["D"],
                                                   dt_bias=i["dt_bias"], seq_idx=seq(s), dt_softplus=True),
            {"x": _leaf(1, T, 2, 8), "dt": _leaf(1, T, 2), "A": _leaf(2, fn=neg), "B": _leaf(1, T, 1, 8),
             "C": _leaf(1, T, 1, 8), "D": _leaf(2), "dt_bias": _leaf(2)},
            {"x": 1, "dt": 1, "B": 1, "C": 1}, 1),
        "mamba_split_conv1d_scan_combined": (
            lambda i, s: mamba_split_conv1d_scan_combined(
                i["zxbcdt"], i["conv_w"], i["conv_b"], i["dt_bias"], i["A"], i["D"], 16, seq_idx=seq(s),
                rmsnorm_weight=i["norm_w"], outproj_weight=i["out_w"], outproj_bias=i["out_b"], headdim=8,
                ngroups=1, norm_before_gate=False),
            # dim 16 (2 heads of 8), one group of state 8: z 16 + xBC 32 + dt 2
            {"zxbcdt": _leaf(1, T, 50), "conv_w": _leaf(32, 4, scale=0.5), "conv_b": _leaf(32),
             "dt_bias": _leaf(2), "A": _leaf(2, fn=neg), "D": _leaf(2), "norm_w": _leaf(16),
             "out_w": _leaf(24, 16, scale=0.25), "out_b": _leaf(24)},
            {"zxbcdt": 1}, 1),
        "flash_attention_2": (
            lambda i, s: flash_attn.flash_attention_forward(None, i["q"], i["k"], i["v"], None, scaling=0.25,
                                                            cu_seq_lens_q=cu(s))[0],
            {"q": _leaf(1, 4, T, 16), "k": _leaf(1, 2, T, 16), "v": _leaf(1, 2, T, 16)},
            {"q": 2, "k": 2, "v": 2}, 1),
    }


def _run(call, inputs, time_dims, out_dim, spans, packed_spans):
    """(output, input gradients) of the packed call (spans: boundaries or None) or, with spans None
    and packed_spans given, of one call per document, concatenated."""
    import torch

    if packed_spans is None:
        out = call(inputs, spans)
    else:
        parts = [call({k: v.narrow(time_dims[k], a, b - a) if k in time_dims else v for k, v in inputs.items()},
                      None) for a, b in packed_spans]
        out = torch.cat(parts, dim=out_dim)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * weight).sum(), list(inputs.values()))
    return out, dict(zip(inputs, grads))


def _max_diff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _check_double(case, spans) -> dict:
    from guard import graph

    call, inputs, time_dims, out_dim = case
    per_doc, per_doc_grads = _run(call, inputs, time_dims, out_dim, None, spans)
    packed, packed_grads = _run(call, inputs, time_dims, out_dim, spans, None)
    unbounded, _ = _run(call, inputs, time_dims, out_dim, None, None)
    os.environ["FTIMAGE_TEST_KERNEL_NO_FUNCTION"] = "1"
    try:
        plain = call(inputs, spans)
    finally:
        del os.environ["FTIMAGE_TEST_KERNEL_NO_FUNCTION"]
    return {"forward": _max_diff(packed, per_doc),
            "grads": {k: _max_diff(packed_grads[k], per_doc_grads[k]) for k in inputs},
            "unbounded": _max_diff(unbounded, per_doc),
            "kernel": graph.inspect_call(call(inputs, spans), inputs).kernel_name,
            "plain": _max_diff(plain, packed),
            "plain_kernel": graph.inspect_call(plain, inputs).kernel_name}


# -- the child: a tiny GraniteMoeHybrid model ---------------------------------------------------------
def _granite() -> dict:
    import causal_conv1d
    import torch
    from mamba_ssm.ops.triton import ssd_combined
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as gm

    from contracts.collate import Document, collate_packed
    from families.binding import read_resolution
    from verify.calltrace import innermost_code, watch_calls

    config = GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, shared_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=4, mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16, mamba_n_groups=1,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128, position_embedding_type="rope",
        attn_implementation="sdpa")
    model = gm.GraniteMoeHybridForCausalLM(config)
    docs = [Document(list(range(1 + i, 1 + i + n)), list(range(1 + i, 1 + i + n))) for i, n in enumerate(LENGTHS)]
    batch = collate_packed(docs, budget=sum(LENGTHS), pad_token_id=0)
    watched = {"split": innermost_code(ssd_combined.mamba_split_conv1d_scan_combined),
               "chunk_scan": innermost_code(ssd_combined.mamba_chunk_scan_combined),
               "conv": innermost_code(causal_conv1d.causal_conv1d_fn)}
    model.train()
    with watch_calls(watched) as train:
        logits = model(**batch, use_cache=False).logits
        logits.sum().backward()
    mixer = model.model.layers[0].mamba
    model.eval()
    with watch_calls(watched) as evaluation, torch.no_grad():
        eval_logits = model(**batch, use_cache=False).logits
    bound = {name: read_resolution(gm, name) for name in ("causal_conv1d_fn", "mamba2_chunk_scan",
                                                         "mamba2_split_conv1d_scan_combined")}
    return {"train": dict(train), "eval": dict(evaluation), "train_vs_eval": _max_diff(logits, eval_logits),
            "backward_reached_mixer": mixer.in_proj.weight.grad is not None and mixer.A_log.grad is not None,
            "bound": {name: [r.is_new, r.implementation.__module__, "seq_idx" in r.applicable_params]
                      for name, r in bound.items()}}


def _kimi_binding() -> list:
    from transformers.models.kimi_linear import modeling_kimi_linear as km

    from families.binding import read_resolution

    r = read_resolution(km, "chunk_kimi_delta_attention")
    return [r.is_new, r.implementation.__module__, "cu_seqlens" in r.applicable_params,
            "cu_seq_lens_q" in r.applicable_params]


def child_main() -> dict:
    import torch

    torch.manual_seed(0)
    spans = [(sum(LENGTHS[:i]), sum(LENGTHS[:i + 1])) for i in range(len(LENGTHS))]
    doubles = {name: _check_double(case, spans) for name, case in _cases().items()}
    return {"doubles": doubles, "granite": _granite(), "kimi": _kimi_binding()}


# -- the tests --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def child() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTIMAGE_") and k != "PYTHONPATH"}
    env.update({"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"})
    proc = subprocess.run([sys.executable, "-I", "-c", CHILD, str(FUSED), str(REPO), __file__],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", DOUBLES)
def test_a_packed_row_with_boundaries_gives_the_per_document_outputs_and_gradients(child, name):
    got = child["doubles"][name]
    assert got["forward"] <= TOL, got
    assert max(got["grads"].values()) <= TOL, got["grads"]


@pytest.mark.parametrize("name", DOUBLES)
def test_without_boundaries_the_documents_leak(child, name):
    assert child["doubles"][name]["unbounded"] > 1e-3, child["doubles"][name]


@pytest.mark.parametrize("name", DOUBLES)
def test_its_backward_is_its_own_function_unless_switched_off(child, name):
    got = child["doubles"][name]
    package = {"causal_conv1d_fn": "causal_conv1d", "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
               "chunk_kda": "fla.ops.kda", "flash_attention_2": "flash_attn"}.get(name, "mamba_ssm.ops.triton")
    assert got["kernel"].startswith(package + "."), got["kernel"]
    assert got["plain"] <= TOL and got["plain_kernel"] == "", got


def test_transformers_binds_the_new_doubles_and_keeps_their_boundary_kwargs(child):
    bound = child["granite"]["bound"]
    assert bound["causal_conv1d_fn"] == [True, "causal_conv1d", True]
    assert bound["mamba2_chunk_scan"] == [True, "mamba_ssm.ops.triton.ssd_combined", True]
    assert bound["mamba2_split_conv1d_scan_combined"] == [True, "mamba_ssm.ops.triton.ssd_combined", True]
    # Kimi's layer passes its **kwargs on unchanged: fla's signature keeps cu_seqlens, drops cu_seq_lens_q
    assert child["kimi"] == [True, "fla.ops.kda", True, False]


def test_the_granite_mixer_calls_the_split_kernel_in_training_and_conv_plus_chunk_scan_in_eval(child):
    granite = child["granite"]
    # (transformers' torch references run only inside the doubles: the bindings above are the doubles)
    assert granite["train"] == {"split": 1, "chunk_scan": 0, "conv": 0}
    assert granite["eval"] == {"split": 0, "chunk_scan": 1, "conv": 1}
    assert granite["backward_reached_mixer"]


def test_the_split_double_computes_what_the_mixers_own_torch_pieces_compute(child):
    # training runs the split double; eval runs conv + chunk scan + transformers' gated norm + out_proj
    assert child["granite"]["train_vs_eval"] <= TOL


if __name__ == "__main__":      # the child: fused/ and the repo are already first on sys.path
    print(json.dumps(child_main()))
