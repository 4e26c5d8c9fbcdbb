"""The guard's parts, one at a time: settings, packed-batch reading, the autograd-graph check,
the decisions (a fused call, the attention, a layer kind's paths, torch.compile) and the closure
reading through the guard's own wrapper."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from entrypoint.observability import console
from families.binding import read_resolution
from guard import batch, graph, rules, settings

pytestmark = pytest.mark.unit


# -- settings -----------------------------------------------------------------------------------------
def test_settings_defaults_and_the_names_entrypoint_uses():
    s = settings.read({})
    assert s.enabled and s.steps == 2 and s.report == "" and not s.allow_fallback and not s.json_logs
    assert settings.ALLOW_FALLBACK_ENV == console.ALLOW_FALLBACK_ENV
    assert settings.JSON_LOGS_ENV == console.JSON_LOGS_ENV
    for value in ("1", "true", "Yes", " on ", "", "0", "off", None):
        assert settings.truthy(value) == console.truthy(value)
    assert settings.read({"FTIMAGE_ALLOW_FALLBACK": "1", "FTIMAGE_GUARD_STEPS": "5"}).steps == 5
    assert not settings.read({"FTIMAGE_GUARD": "OFF"}).enabled
    assert not s.allow_compile and settings.read({"FTIMAGE_GUARD_ALLOW_COMPILE": " Yes "}).allow_compile
    assert not settings.read({"FTIMAGE_GUARD_ALLOW_COMPILE": "0"}).allow_compile


@pytest.mark.parametrize("env", [{"FTIMAGE_GUARD_STEPS": "0"}, {"FTIMAGE_GUARD_STEPS": "-1"},
                                 {"FTIMAGE_GUARD_STEPS": "2.5"}, {"FTIMAGE_GUARD_STEPS": "²"},
                                 {"FTIMAGE_GUARD_STEPS": "9999999"}, {"FTIMAGE_GUARD": "maybe"},
                                 {"FTIMAGE_GUARD_ALLOW_COMPILE": "maybe"}, {"FTIMAGE_GUARD_ALLOW_COMPILE": "2"}])
def test_malformed_settings_are_one_problem_with_a_fix(env):
    with pytest.raises(settings.BadSetting) as info:
        settings.read(env)
    assert info.value.problem and info.value.fix


def test_each_rank_writes_its_own_report():
    assert settings.report_path("/out/g.json", {}) == "/out/g.json"
    assert settings.report_path("/out/g.json", {"RANK": "0", "WORLD_SIZE": "2"}) == "/out/g.json"
    assert settings.report_path("/out/g.json", {"RANK": "3", "WORLD_SIZE": "4"}) == "/out/g.rank3.json"


# -- packed batches -----------------------------------------------------------------------------------
def test_position_resets_inside_a_row_are_a_packed_batch():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    b = batch.inspect_batch({"input_ids": torch.zeros_like(pos), "position_ids": pos}, training=True)
    assert b.packed and b.position_packed and b.documents == 3 and b.layout == "2d"
    assert b.docs.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    plain = batch.inspect_batch({"input_ids": torch.zeros(2, 5, dtype=torch.long),
                                 "position_ids": torch.arange(5).expand(2, 5)}, training=True)
    assert plain.packed is False


def test_padding_is_not_read_as_a_document_boundary():
    # left padding as generate() builds it (positions 1, 1, 0, 1, 2) and right padding with position 0
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    pos = torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 0, 0]])
    b = batch.inspect_batch({"input_ids": torch.zeros_like(pos), "position_ids": pos, "attention_mask": mask}, True)
    assert b.packed is False
    packed = batch.inspect_batch({"input_ids": torch.zeros(1, 5, dtype=torch.long), "attention_mask": torch.tensor(
        [[1, 1, 1, 1, 0]]), "position_ids": torch.tensor([[0, 1, 0, 1, 0]])}, True)
    assert packed.packed and packed.documents == 2


def test_mrope_position_ids_are_not_misread():
    text = torch.tensor([0, 1, 2, 3, 4, 5])
    # (3, B, T) t/h/w for one document with an image: height and width restart inside it
    image = torch.stack([torch.tensor([0, 1, 2, 2, 2, 2]), torch.tensor([0, 1, 2, 2, 3, 3]),
                         torch.tensor([0, 1, 2, 3, 2, 3])])[:, None]
    assert batch.inspect_batch({"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": image},
                               True).packed is False
    two_docs = torch.stack([torch.tensor([0, 1, 2, 0, 1, 2])] * 3)[:, None]
    b = batch.inspect_batch({"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": two_docs}, True)
    assert b.packed and b.layout == "mrope3" and b.documents == 2
    # (4, B, T): row 0 is the text positions, which transformers reads; the rest is MRoPE
    four = torch.stack([torch.tensor([0, 1, 2, 0, 1, 2]), text, text, text])[:, None]
    b = batch.inspect_batch({"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": four}, True)
    assert b.packed and b.layout == "mrope4"
    odd = batch.inspect_batch({"input_ids": torch.zeros(1, 6, dtype=torch.long),
                               "position_ids": torch.zeros(2, 1, 6, dtype=torch.long)}, True)
    assert odd.packed is False and odd.notes


def test_boundaries_without_position_ids_still_make_a_packed_batch():
    ids = torch.zeros(1, 6, dtype=torch.long)
    cu = batch.inspect_batch({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 2, 6], dtype=torch.int32)}, True)
    assert cu.packed and cu.docs.tolist() == [[0, 0, 1, 1, 1, 1]]
    seq = batch.inspect_batch({"input_ids": ids, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32)},
                              True)
    assert seq.packed and seq.kwargs_seen == ("seq_idx",)


def test_a_mask_either_keeps_documents_apart_or_not():
    docs = torch.tensor([[0, 0, 1, 1]])
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    block = causal & (docs[0, :, None] == docs[0, None, :])
    assert batch.mask_separates(block[None, None], docs) == (True, "")
    assert batch.mask_separates(causal[None, None], docs)[0] is False
    assert batch.mask_separates(None, docs)[0] is False
    additive = torch.zeros(1, 1, 4, 4).masked_fill(~block, torch.finfo(torch.float32).min)
    assert batch.mask_separates(additive, docs)[0] is True
    assert batch.mask_separates(object(), docs)[0] is None


# -- the autograd graph ---------------------------------------------------------------------------------
class ftimage_kernel_double(torch.autograd.Function):   # noqa: N801 - named like a kernel package's Function
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


ftimage_kernel_double.__module__ = "somekernel.ops"


def test_the_kernel_function_of_this_call_is_found_and_an_earlier_one_is_not():
    x = torch.ones(3, requires_grad=True)
    earlier = ftimage_kernel_double.apply(x)            # an earlier layer's kernel
    fused = graph.inspect_call(ftimage_kernel_double.apply(earlier).view(3, 1), (earlier,))
    assert fused.kernel is not None and fused.kernel_name.startswith("somekernel.ops.")
    aten = graph.inspect_call((earlier * 3).sum(), (earlier,))
    assert aten.kernel is None and aten.root is not None and "torch autograd ops" in aten.describe
    assert graph.inspect_call(torch.ones(2), ()).root is None
    counts: dict = {}
    out = ftimage_kernel_double.apply(x)
    graph.count_backward(graph.inspect_call(out, (x,)).kernel, counts, "backward_fused")
    out.sum().backward()
    assert counts == {"backward_fused": 1} and not graph.in_backward()


# -- decisions ----------------------------------------------------------------------------------------
CONV = rules.Call(function="causal_conv1d_fn", wrapper="causal_conv1d_fn", kind="linear_attention",
                  boundary_kwarg="seq_idx", bound="transformers.x.causal_conv1d_fn", fused=False,
                  accepts_boundary=False, why="`causal_conv1d` is present at /x but `import causal_conv1d` raises "
                  "ImportError: undefined symbol: foo", package="causal_conv1d")
FUSED = rules.Call(**{**CONV.__dict__, "fused": True, "accepts_boundary": True, "bound": "causal_conv1d.fn", "why": ""})


def test_the_torch_fallback_on_packed_input_is_never_let_through():
    found, override = rules.fused_call(CONV, packed=True, boundary_given=True, allow_fallback=True)
    assert not override and len(found) == 1
    assert "importing causal_conv1d failed: ImportError: undefined symbol: foo" in found[0].message
    assert "it drops seq_idx" in found[0].message and "installed but broken" in found[0].fix[0]
    found, _ = rules.fused_call(CONV, packed=True, boundary_given=False, allow_fallback=True)
    assert "packed batch without seq_idx reached causal_conv1d_fn" in found[0].message and len(found) == 2


def test_the_override_lets_the_torch_fallback_run_on_unpacked_input_only():
    found, override = rules.fused_call(CONV, packed=False, boundary_given=False, allow_fallback=True)
    assert not found and override.startswith("FTIMAGE_ALLOW_FALLBACK=1: causal_conv1d_fn: torch reference")
    found, override = rules.fused_call(CONV, packed=False, boundary_given=False, allow_fallback=False)
    assert found and not override and any("FTIMAGE_ALLOW_FALLBACK=1" in line for line in found[0].fix)


def test_a_fused_kernel_needs_the_boundary_on_packed_input():
    assert rules.fused_call(FUSED, packed=True, boundary_given=True, allow_fallback=False) == ([], "")
    assert rules.fused_call(FUSED, packed=None, boundary_given=False, allow_fallback=False) == ([], "")
    missing, _ = rules.fused_call(FUSED, packed=True, boundary_given=False, allow_fallback=False)
    assert missing[0].message.startswith("packed batch without seq_idx reached causal_conv1d_fn")
    old = rules.Call(**{**FUSED.__dict__, "accepts_boundary": False})
    assert "takes no seq_idx" in rules.fused_call(old, True, True, False)[0][0].message


def test_attention_decisions():
    sdpa = rules.AttentionCall(implementation="sdpa", wanted="flash_attention_2", function="t.sdpa_attention_forward")
    across, _ = rules.attention_call(sdpa, True, True, False, "no mask", allow_fallback=True)
    assert across[0].message == "full_attention: sdpa attends across packed documents (no mask)"
    masked, override = rules.attention_call(sdpa, True, True, True, "", allow_fallback=True)
    assert not masked and "keeps the packed documents apart" in override
    refused, _ = rules.attention_call(sdpa, False, False, None, "", allow_fallback=False)
    assert "runs instead of flash_attention_2" in refused[0].message
    flash = rules.AttentionCall(implementation="flash_attention_2", wanted="flash_attention_2", function="f")
    assert rules.attention_call(flash, True, True, None, "", False) == ([], "")
    assert "without cu_seq_lens_q" in rules.attention_call(flash, True, False, None, "", False)[0][0].message


# -- the closure through the guard's wrapper ------------------------------------------------------------
def test_families_binding_reads_transformers_closure_through_the_guards_wrapper():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    plain = read_resolution(m, "causal_conv1d_fn")
    original = m.causal_conv1d_fn

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        return original(*args, **kwargs)

    wrapped = type("M", (), {"__name__": "m", "causal_conv1d_fn": staticmethod(guarded)})
    through = read_resolution(wrapped, "causal_conv1d_fn")
    assert through.readable and through.implementation is plain.implementation
    assert through.func_name == "causal_conv1d_fn" and through.package == "causal_conv1d"


# -- a layer kind: one of its complete fused paths must run in each call -----------------------------------
GDN_PATHS = (("causal_conv1d_fn", "chunk_gated_delta_rule"),)
MAMBA2_PATHS = (("mamba_split_conv1d_scan_combined",), ("causal_conv1d_fn", "mamba_chunk_scan_combined"))
REBOUND = {"causal_conv1d_fn": "transformers.x.causal_conv1d_fn (transformers' torch reference itself, unwrapped)"}


def layer(ran, paths=GDN_PATHS, rebound=None, packed=True, allow_fallback=False, runs=2):
    return rules.layer_kind_call("linear_attention", "Qwen3_5GatedDeltaNet", runs, frozenset(ran), paths,
                                 rebound or {}, packed, allow_fallback)


def test_a_layer_kind_that_ran_while_its_functions_did_not_is_refused_naming_what_is_bound_now():
    assert layer({"causal_conv1d_fn", "chunk_gated_delta_rule"}) == (None, "")
    assert layer(set(), runs=0) == (None, "")          # a kind that never ran is not judged here
    violation, override = layer(set(), rebound=REBOUND, packed=False, allow_fallback=True)
    assert not override and violation.function == "linear_attention"
    assert violation.message.startswith("linear_attention (Qwen3_5GatedDeltaNet) ran 2 time(s) without a complete "
                                        "fused path (causal_conv1d_fn + chunk_gated_delta_rule)")
    assert "causal_conv1d_fn is now transformers.x.causal_conv1d_fn (transformers' torch reference itself" \
        in violation.message
    assert "remove the code that rebinds them" in violation.fix[0]
    violation, _ = layer(set())
    assert "called none of the functions the guard checks" in violation.message
    # the fallback override covers transformers' own code on an unpacked batch, never a packed one
    assert layer(set(), packed=False, allow_fallback=True)[1].startswith("FTIMAGE_ALLOW_FALLBACK=1: linear_attention")
    assert layer(set(), packed=None, allow_fallback=True)[0] is not None
    attention, _ = rules.layer_kind_call("full_attention", "Qwen3_5Attention", 1, frozenset(), (("attention",),),
                                         {}, True, False)
    assert "the attention function from ALL_ATTENTION_FUNCTIONS.get_interface" in attention.message


def test_a_partial_mamba2_path_is_refused_and_either_complete_path_passes():
    assert layer({"mamba_split_conv1d_scan_combined"}, MAMBA2_PATHS) == (None, "")
    assert layer({"causal_conv1d_fn", "mamba_chunk_scan_combined"}, MAMBA2_PATHS) == (None, "")
    partial, _ = layer({"causal_conv1d_fn"}, MAMBA2_PATHS)
    assert partial is not None and ": only causal_conv1d_fn ran" in partial.message
    assert "(mamba_split_conv1d_scan_combined or causal_conv1d_fn + mamba_chunk_scan_combined)" in partial.message
    assert layer({"mamba_chunk_scan_combined"}, MAMBA2_PATHS)[0] is not None
    assert rules.complete_path({"causal_conv1d_fn", "mamba_chunk_scan_combined", "x"}, MAMBA2_PATHS) == \
        ("causal_conv1d_fn", "mamba_chunk_scan_combined")


FUNCTIONS = ("causal_conv1d_fn", "chunk_gated_delta_rule", "mamba_chunk_scan_combined",
             "mamba_split_conv1d_scan_combined", "attention")
NAMES = st.sampled_from(FUNCTIONS)
PATHS = st.lists(st.lists(NAMES, min_size=1, max_size=3, unique=True).map(tuple), min_size=1, max_size=3).map(tuple)
BOUND_NOW = st.text(alphabet="abcdefghijklmnopqrstuvwxyz._()", min_size=1, max_size=30)
REBINDINGS = st.dictionaries(st.sampled_from(("causal_conv1d_fn", "torch_chunk_gated_delta_rule",
                                              "ALL_ATTENTION_FUNCTIONS.get_interface")), BOUND_NOW, max_size=3)


@hypothesis_settings(max_examples=200, deadline=None)
@given(paths=PATHS, ran=st.frozensets(NAMES), rebound=REBINDINGS, runs=st.integers(1, 64),
       packed=st.sampled_from((True, None, False)), allow_fallback=st.booleans())
def test_a_layer_that_ran_passes_iff_some_complete_path_ran_and_a_rebinding_is_always_named(
        paths, ran, rebound, runs, packed, allow_fallback):
    violation, override = rules.layer_kind_call("k", "K", runs, ran, paths, rebound, packed, allow_fallback)
    complete = any(set(path) <= ran for path in paths)
    if complete:
        assert violation is None and override == ""
        return
    if rebound or not (packed is False and allow_fallback):
        assert violation is not None and not override and violation.fix
        assert all(f"{name} is now {now}" in violation.message for name, now in rebound.items())
    else:
        assert violation is None and override.startswith("FTIMAGE_ALLOW_FALLBACK=1: k (K) ran")
    assert rules.layer_kind_call("k", "K", 0, ran, paths, rebound, packed, allow_fallback) == (None, "")


@hypothesis_settings(max_examples=200, deadline=None)
@given(present=st.integers(0, 64), seen=st.integers(0, 64), bypass=st.lists(BOUND_NOW, max_size=3).map(tuple))
def test_layers_the_model_holds_but_the_guard_did_not_see_run_are_refused(present, seen, bypass):
    violation = rules.layers_unseen("linear_attention", "Qwen3_5GatedDeltaNet", present, seen, bypass)
    assert (violation is not None) == (seen < present)
    if violation is not None:
        assert f"holds {present} Qwen3_5GatedDeltaNet layer(s)" in violation.message
        assert all(b in violation.message for b in bypass)


def test_a_compiled_training_forward_is_refused_naming_torch_compile_or_with_the_override_is_silent():
    violation, override = rules.compiled_call("Qwen3_5ForCausalLM.forward", 2, allow_compile=False)
    assert not override and violation.function == "torch.compile" and "ran under torch.compile" in violation.message
    assert "first 2 training step(s)" in violation.fix[0] and "FTIMAGE_GUARD_ALLOW_COMPILE=1" in violation.fix[1]
    violation, override = rules.compiled_call("Qwen3_5ForCausalLM.forward", 2, allow_compile=True)
    assert violation is None and override.startswith("FTIMAGE_GUARD_ALLOW_COMPILE=1: ") and "silent" in override
