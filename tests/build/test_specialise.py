"""Model-aware kernel specialisation: derived from the family, part of the key, shown by --plan,
recorded in the lock; bad combinations are exit 2 with the field and the fix."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from build.resolve import load_plan

pytestmark = pytest.mark.unit


def kernel(plan, name):
    return next(k for k in plan.kernels if k.name == name)


def test_qwen_flash_attn_is_trimmed_to_the_family(ws):
    fa = kernel(load_plan(ws.image("qwen27b"), ws.manifest), "flash-attn")
    s = fa.specialisation
    assert s.head_dims == (256,) and s.dtypes == ("bf16",) and s.family == "qwen3_5_text"
    assert set(s.disabled) == {"dropout", "alibi", "softcap", "sliding_window", "uneven_head_dim"}
    assert fa.build_env["FLASH_ATTN_HEAD_DIMS"] == "256" and fa.build_env["FLASH_ATTN_DTYPES"] == "bf16"
    assert fa.build_env["FLASH_ATTN_DISABLE"].split(";") == ["DROPOUT", "ALIBI", "SOFTCAP", "LOCAL", "UNEVEN_K"]
    assert fa.estimate.sources == 7                       # 6 per (head dim, dtype) + flash_api.cpp
    assert list(fa.key_inputs["specialisation"]["head_dims"]) == [256]


def test_plan_shows_the_specialisation_and_its_cost(ws, run_cli):
    code, out, err = run_cli(ws.plan("qwen27b"))
    assert code == 0, err
    assert "specialise flash-attn: for qwen3_5_text: head dims 256; dtypes bf16; compiled without dropout" in out
    assert "7 sources" in out
    code, out, _ = run_cli(ws.plan("qwen27b", "--json"))
    fa = next(k for k in json.loads(out)["kernels"] if k["name"] == "flash-attn")
    assert fa["specialisation"]["head_dims"] == [256] and fa["estimate"]["sources"] == 7


def test_opting_out_builds_the_generic_kernel_with_its_cost_in_the_plan(ws, run_cli):
    before = kernel(load_plan(ws.image("qwen27b"), ws.manifest), "flash-attn")
    before_fla = kernel(load_plan(ws.image("qwen27b"), ws.manifest), "flash-linear-attention").key
    data = ws.load("qwen27b")
    data["specialise_kernels"] = False
    ws.save("qwen27b", data)
    plan = load_plan(ws.image("qwen27b"), ws.manifest)
    fa = kernel(plan, "flash-attn")
    assert fa.specialisation.generic and "FLASH_ATTN_HEAD_DIMS" not in fa.build_env
    assert fa.key != before.key and fa.estimate.sources == 73
    assert fa.estimate.cpu_seconds > 10 * before.estimate.cpu_seconds
    code, out, _ = run_cli(ws.plan("qwen27b"))
    assert "specialise flash-attn: generic; 73 sources to compile" in out
    conv = kernel(plan, "causal-conv1d")
    assert conv.specialisation.generic and "CAUSAL_CONV1D_DTYPES" not in conv.build_env
    # a kernel with no knobs (the pure-Python fla) keeps its key: only what can change, changes
    assert kernel(plan, "flash-linear-attention").key == before_fla


def _family_copy(ws, monkeypatch, edit):
    """A copy of the families folder with one edit, in place of the real one."""
    import families

    root = ws.root / "families"
    shutil.copytree(families.FAMILIES_DIR, root)
    path = root / "qwen3_5_text.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setattr(families, "FAMILIES_DIR", root)
    families.known_families.cache_clear()
    families.load_family.cache_clear()
    yield
    families.known_families.cache_clear()
    families.load_family.cache_clear()


@pytest.fixture
def family_edit(ws, monkeypatch):
    gens = []

    def apply(edit):
        gen = _family_copy(ws, monkeypatch, edit)
        next(gen)
        gens.append(gen)
    yield apply
    for gen in gens:
        next(gen, None)


def test_causal_conv1d_is_trimmed_to_the_family_dtypes(ws):
    conv = kernel(load_plan(ws.image("qwen27b"), ws.manifest), "causal-conv1d")
    assert conv.specialisation.dtypes == ("bf16",) and conv.specialisation.head_dims == ()
    assert conv.build_env["CAUSAL_CONV1D_DTYPES"] == "bf16" and conv.estimate.sources == 4


def test_family_head_dim_the_kernel_cannot_build_is_exit_2(ws, run_cli, family_edit):
    family_edit(lambda d: d["attention"].update(head_dims=[512]))
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2 and "Traceback" not in err
    assert "families/qwen3_5_text.yaml: attention.head_dims[0]: " in err
    assert "has no kernel for head dim 512" in err and "fix: " in err


def test_specialisation_conflicting_with_the_attention_implementation_is_exit_2(ws, run_cli):
    data = ws.load("kernel-smoke")
    data["runtime"]["attn_implementation"] = "sdpa"
    ws.save("kernel-smoke", data)
    code, _, err = run_cli(ws.plan("kernel-smoke"))
    assert code == 2
    assert "image.yaml: runtime.attn_implementation: flash-attn is specialised for flash_attention_2" in err


def test_fp16_training_on_a_bf16_specialisation_is_exit_2(ws, run_cli):
    path = ws.image("qwen27b") / "finetune.yaml"
    path.write_text(path.read_text().replace("param_dtype: bfloat16", "param_dtype: float16"))
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2
    assert "finetune.defaults.parallel.param_dtype: the image trains in float16" in err


def test_the_lock_records_what_was_compiled(ws):
    from pathlib import Path

    from build.context import make_lock
    from build.kernels.wheel import KernelWheel

    plan = load_plan(ws.image("qwen27b"), ws.manifest)
    fa = kernel(plan, "flash-attn")
    wheel = KernelWheel(name="flash-attn", key=fa.key, filename="flash_attn-2.8.3.post2-cp311-cp311-linux_x86_64.whl",
                        sha256="b" * 64, path=Path("/x"), archs=("sm_90", "sm_100"))
    locked = make_lock(plan, (), (wheel,), {}).kernels[0]
    assert locked.specialisation == fa.specialisation and locked.profile_kernels["backward"] == ("flash_bwd",)


def test_an_image_pinning_a_triton_its_kernels_cannot_use_is_exit_2(ws, run_cli):
    manifest = ws.load_manifest()
    manifest["kernels"]["flash-linear-attention"]["runtime_requires"] = ["einops==0.8.2", "triton==3.6.0"]
    ws.save_manifest(manifest)
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2
    assert "python.requirements: the image pins triton 3.6.0, but flash-linear-attention needs triton>=3.7.1" in err
