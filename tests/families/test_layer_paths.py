"""A family's layer kinds: the token-mixer class the runtime guard wraps (`layer_class:`) and the
complete fused paths one layer call must run (`paths:`), read and checked like every other field."""
from __future__ import annotations

import copy

import pytest

from contracts import safe_yaml
from contracts.schema import Problems
from families import ATTENTION_PATH, FAMILIES_DIR, FamilyError, FusedFunction, LayerKind, load_family, read_family

pytestmark = pytest.mark.unit

MAMBA2 = LayerKind(
    module="mixer", layer_class="Mamba2Mixer",
    fused=(FusedFunction(function="causal_conv1d_fn", wrapper="causal_conv1d_fn", boundary_kwarg="seq_idx"),
           FusedFunction(function="mamba_chunk_scan_combined", wrapper="mamba_chunk_scan_combined",
                         boundary_kwarg="seq_idx"),
           FusedFunction(function="mamba_split_conv1d_scan_combined", wrapper="mamba_split_conv1d_scan_combined",
                         boundary_kwarg="seq_idx")),
    paths=(("mamba_split_conv1d_scan_combined",), ("causal_conv1d_fn", "mamba_chunk_scan_combined")))


def raw() -> dict:
    return copy.deepcopy(safe_yaml.load_file(FAMILIES_DIR / "qwen3_5_text.yaml"))


def problems_of(data: dict) -> list:
    problems = Problems()
    read_family("qwen3_5_text", data, problems)
    with pytest.raises(FamilyError) as info:
        problems.raise_if_any(FamilyError)
    return info.value.problems


def test_qwen3_5_names_its_token_mixers_and_each_kind_has_one_complete_path():
    kinds = load_family("qwen3_5_text").layer_kinds
    assert kinds["linear_attention"].layer_class == "Qwen3_5GatedDeltaNet"
    assert kinds["full_attention"].layer_class == "Qwen3_5Attention"
    # absent `paths:`: every fused function of the kind; no fused functions: the attention function
    assert kinds["linear_attention"].complete_paths() == (("causal_conv1d_fn", "chunk_gated_delta_rule"),)
    assert kinds["full_attention"].complete_paths() == ((ATTENTION_PATH,),)
    assert MAMBA2.complete_paths() == MAMBA2.paths


def test_the_token_mixer_classes_are_those_of_the_installed_modeling_module():
    from families.runtime import modeling_module

    family = load_family("qwen3_5_text")
    module = modeling_module(family)
    for kind in family.layer_kinds.values():
        assert "forward" in vars(getattr(module, kind.layer_class)), kind


def test_a_path_naming_a_function_the_kind_does_not_fuse_is_one_problem_with_the_fix():
    data = raw()
    data["layer_kinds"]["linear_attention"]["paths"] = [["causal_conv1d_fn", "mamba_chunk_scan_combined"]]
    [problem] = problems_of(data)
    assert problem.field == "layer_kinds.linear_attention.paths[0][1]"
    assert "'mamba_chunk_scan_combined' is not a fused function of layer kind linear_attention" in problem.problem
    assert "causal_conv1d_fn, chunk_gated_delta_rule" in problem.fix and "fused" in problem.fix


def test_an_empty_path_is_one_problem_with_the_fix():
    data = raw()
    data["layer_kinds"]["linear_attention"]["paths"] = [["causal_conv1d_fn", "chunk_gated_delta_rule"], []]
    [problem] = problems_of(data)
    assert problem.field == "layer_kinds.linear_attention.paths[1]" and problem.problem == "an empty path"
    assert "complete fused path" in problem.fix


def test_a_path_on_a_kind_without_fused_functions_and_a_missing_layer_class_are_named():
    data = raw()
    data["layer_kinds"]["full_attention"]["paths"] = [["attention"]]
    del data["layer_kinds"]["linear_attention"]["layer_class"]
    found = {p.field: p for p in problems_of(data)}
    assert found["layer_kinds.linear_attention.layer_class"].problem == "required field is missing"
    assert "layer_class: Qwen3_5GatedDeltaNet" in found["layer_kinds.linear_attention.layer_class"].fix
    # the reader drops a kind it cannot build, so the path check sees the other kind only
    attention = found["layer_kinds.full_attention.paths[0][0]"]
    assert "has no fused functions" in attention.problem and "remove `paths:`" in attention.fix
