"""An image for several model families: `model_families:` in image.yaml, the plan's per-family
table of fused functions and their kernels, the refusal of a CUDA image that leaves one unfused,
and a one-family image's plan untouched by facts added for other families."""
from __future__ import annotations

from pathlib import Path

import pytest

from build.resolve import load_plan
from contracts.schema import Problems
from families import load_family, read_family, source_check

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
QWEN27B_PLAN_KEY = "47c2c3bb33853f0588b08d49790b2554f1e79a1ffc578fd3ef92eb01c1ec3fee"


def two_families(ws, name="qwen27b"):
    data = ws.load(name)
    data.pop("model_family")
    data["model_families"] = ["qwen3_5_text", "kimi_linear"]
    return data


def test_the_plan_lists_each_family_s_fused_functions_with_their_kernel(ws, run_cli):
    ws.save("qwen27b", two_families(ws))
    code, out, err = run_cli(ws.plan("qwen27b"))
    assert code == 0, err
    assert "model families qwen3_5_text, kimi_linear" in out
    table = out.split("FAMILY", 1)[1].split("KERNEL", 1)[0]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert ["qwen3_5_text", "linear_attention", "chunk_gated_delta_rule", "flash-linear-attention"] in rows
    assert ["kimi_linear", "linear_attention", "chunk_kda", "flash-linear-attention"] in rows
    assert ["kimi_linear", "linear_attention", "causal_conv1d_fn", "causal-conv1d"] in rows


def test_flash_attn_is_compiled_for_the_union_of_the_families_head_dims(ws):
    ws.save("qwen27b", two_families(ws))
    plan = load_plan(ws.image("qwen27b"), ws.manifest)
    flash = next(k for k in plan.kernels if k.name == "flash-attn")
    wanted = sorted(set(load_family("qwen3_5_text").attention.head_dims)
                    | set(load_family("kimi_linear").attention.head_dims))
    assert list(flash.specialisation.head_dims) == wanted
    assert flash.build_env["FLASH_ATTN_HEAD_DIMS"] == ";".join(map(str, wanted))
    assert plan.body["model_families"] == ["qwen3_5_text", "kimi_linear"] and "model_family" not in plan.body


def test_a_cuda_image_leaving_a_family_function_unfused_is_exit_2_naming_family_function_and_fix(ws, run_cli):
    data = two_families(ws)
    data["kernels"] = ["flash-attn", "causal-conv1d"]
    ws.save("qwen27b", data)
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2 and "Traceback" not in err
    assert "model_families[1]: model family kimi_linear needs chunk_kda fused" in err
    assert "model_families[0]: model family qwen3_5_text needs chunk_gated_delta_rule fused" in err
    assert "fix: add flash-linear-attention to kernels" in err


def test_a_cpu_image_lists_an_unfused_function_as_the_torch_reference(ws, run_cli):
    data = ws.load("smoke")
    data.pop("model_family")
    data["model_families"] = ["qwen3_5_text", "lfm2"]
    ws.save("smoke", data)
    code, out, err = run_cli(ws.plan("smoke"))
    assert code == 0, err
    assert "causal_conv1d_fn             torch reference (CPU image)" in out.replace("  lfm2", "")


@pytest.mark.parametrize("families, problem", [
    (["qwen3_5_text", "no_such_family"], "model_families[1]: unknown model family 'no_such_family'"),
    (["qwen3_5_text", "qwen3_5_text"], "model_families[1]: family 'qwen3_5_text' is listed twice"),
])
def test_bad_model_families_are_exit_2_naming_the_entry(ws, run_cli, families, problem):
    data = ws.load("qwen27b")
    data.pop("model_family")
    data["model_families"] = families
    ws.save("qwen27b", data)
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2 and "Traceback" not in err
    assert problem in err and "fix: " in err


def test_model_family_and_model_families_together_is_exit_2(ws, run_cli):
    data = ws.load("qwen27b")
    data["model_families"] = ["qwen3_5_text"]
    ws.save("qwen27b", data)
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2 and "both model_family and model_families are given" in err


def test_a_function_added_to_a_kernel_for_another_family_leaves_a_one_family_plan_unchanged(ws):
    manifest = ws.load_manifest()
    fla = manifest["kernels"]["flash-linear-attention"]
    assert "chunk_kda" in fla["replaces"], "the manifest's fla provides Kimi Linear's chunk_kda"
    assert load_plan(ws.image("qwen27b"), ws.manifest).plan_key == QWEN27B_PLAN_KEY
    fla["replaces"] = [r for r in fla["replaces"] if r != "chunk_kda"]
    fla["python_api"].pop("chunk_kda")
    ws.save_manifest(manifest)
    assert load_plan(ws.image("qwen27b"), ws.manifest).plan_key == QWEN27B_PLAN_KEY


def family_problems(edit, name="kimi_linear"):
    from contracts import safe_yaml
    from families import FAMILIES_DIR

    data = safe_yaml.load_file(FAMILIES_DIR / f"{name}.yaml")
    edit(data)
    problems = Problems()
    read_family(name, data, problems)
    return [(p.field, p.problem) for p in problems]


def test_a_family_file_with_an_unknown_key_is_a_problem_naming_it():
    [(field, problem)] = family_problems(lambda d: d.update(layer_kind={}))
    assert field == "layer_kind" and "unknown" in problem


def test_a_boundary_kwarg_no_kernel_takes_is_a_problem():
    def edit(d):
        d["layer_kinds"]["linear_attention"]["fused"][0]["boundary_kwarg"] = "doc_ids"
    [(field, _)] = family_problems(edit)
    assert field == "layer_kinds.linear_attention.fused[0].boundary_kwarg"


def test_a_modeling_module_missing_from_the_pinned_transformers_is_a_problem():
    found = family_problems(lambda d: d.update(modeling_module="transformers.models.kimi.modeling_kimi"))
    assert found[0][0] == "modeling_module" and "is not in transformers" in found[0][1]


def test_a_wrapper_whose_function_takes_no_boundary_kwarg_is_a_problem():
    import dataclasses

    family = load_family("qwen3_5_text")
    kind = family.layer_kinds["linear_attention"]
    conv = dataclasses.replace(kind.fused[0], wrapper="causal_conv1d_update", function="causal_conv1d_update")
    bad = dataclasses.replace(family, layer_kinds={**family.layer_kinds, "linear_attention": dataclasses.replace(
        kind, fused=(conv, *kind.fused[1:]))})
    found = source_check.problems(bad)
    assert [f for f, *_ in found] == ["layer_kinds.linear_attention.fused[0].boundary_kwarg"]
    assert "takes no `seq_idx`" in found[0][1]


@pytest.mark.parametrize("image", sorted(p.parent.name for p in (REPO / "images").glob("*/image.yaml")))
def test_every_shipped_image_resolves(image):
    plan = load_plan(REPO / "images" / image)
    assert plan.spec.families and plan.plan_key


def test_a_kernel_providing_nothing_the_families_use_is_exit_2(ws, run_cli):
    data = ws.load("qwen27b")
    data["kernels"] = [*data["kernels"], "mamba-ssm"]
    ws.save("qwen27b", data)
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2 and "mamba-ssm provides nothing the image's families use" in err
    assert "fix: drop mamba-ssm, or add a family that needs it" in err
