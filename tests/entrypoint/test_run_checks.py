"""What a run refuses or warns about before any rank starts (no training)."""
from __future__ import annotations

import json

import pytest

from contracts.finetune_config import ConfigError, build_config
from entrypoint.launcher.preflight import FinetuneError, prepare
from entrypoint.launcher.verify_gate import GateOutcome
from tests.fixtures.chat import entrypoint_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("key, value, field", [
    ("output", {"report_to": ["tensorboard", "neptune"]}, "output.report_to[1]"),
    ("checkpoint", {"allow_changed": ["train.lrr"]}, "checkpoint.allow_changed[0]"),
    ("checkpoint", {"allow_changed": ["model.path"]}, "checkpoint.allow_changed[0]"),
    ("train", {"epochs": 0}, "train.epochs"),
    ("train", {"epochs": -3}, "train.epochs"),
])
def test_bad_run_keys_name_the_field_and_the_fix(key, value, field):
    with pytest.raises(ConfigError) as info:
        build_config([{key: value}], require_paths=False)
    problem = next(p for p in info.value.problems if p.field == field)
    assert problem.fix
    if value == {"allow_changed": ["train.lrr"]}:
        assert "did you mean train.lr" in problem.problem and "train.max_steps" in problem.fix


def _passing_gate(**_):
    return GateOutcome(passed=True, worst="PASS", table="(stand-in)", report={})


def test_a_tracker_that_is_not_installed_is_a_config_error(fixture_dir, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(FinetuneError) as info:
        prepare(config_file=str(fixture_dir.config), overrides=[f"output.dir={tmp_path}", "output.report_to=[wandb]"],
                allow_fallback=False, env=entrypoint_env(), log=lambda m: None, gate=_passing_gate)
    assert "wandb package is not installed" in str(info.value) and "python.requirements" in info.value.fix


def test_warnings_for_a_schedule_bad_rows_and_too_little_data(fixture_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    good = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you"}]}
    data.write_text("\n".join([json.dumps(good)] * 2 + ["{broken"] * 3 + [json.dumps({"x": 1})]) + "\n")
    said: list[str] = []
    prepare(config_file=str(fixture_dir.config), allow_fallback=False, env=entrypoint_env(), log=said.append,
            gate=_passing_gate, overrides=[f"output.dir={tmp_path / 'out'}", f"data.path={data}", "train.max_steps=3",
                                           "train.warmup_steps=50", "launch.nproc_per_node=2", "train.grad_accum=2"])
    text = "\n".join(said)
    assert "train.warmup_steps (50) >= train.max_steps (3)" in text
    assert "4 of 6 rows (67%) are bad" in text
    assert "fewer than one step needs (2 ranks x grad_accum 2)" in text


@pytest.mark.parametrize("tree, field, said", [
    ({"data": {"sources": [{"path": "a.jsonl", "weight": float("nan")}]}}, "data.sources[0].weight",
     "nan is not a finite number (allowed: a finite number > 0.0)"),
    ({"data": {"sources": [{"path": "a.jsonl", "weight": "inf"}]}}, "data.sources[0].weight",
     "inf is not a finite number (allowed: a finite number > 0.0)"),
    ({"train": {"lr": 10 ** 400}}, "train.lr", "is not a finite number (allowed: a finite number > 0.0)"),
    ({"data": {"eval_fraction": "-inf"}}, "data.eval_fraction",
     "-inf is not a finite number (allowed: a finite number >= 0.0 and <= 0.5)"),
    ({"train": {"min_lr_ratio": "nan"}}, "train.min_lr_ratio", "(allowed: a finite number >= 0.0 and <= 1.0)"),
    ({"output": {"peak_tflops": 1e308}}, "output.peak_tflops", "1e+308 is out of range (allowed: a finite number "
                                                              ">= 0.0 and <= 1000000.0)"),
    ({"train": {"seed": 2 ** 64}}, "train.seed", "is out of range (allowed: an integer >= 0 and < 2**63)"),
    ({"packing": {"budget": 1 << 31}}, "packing.budget", "(allowed: an integer >= 1 and <= 16777216)"),
])
def test_numbers_past_their_limits_name_the_field_and_the_allowed_range(tree, field, said):
    with pytest.raises(ConfigError) as info:
        build_config([tree], require_paths=False)
    problem = next(p for p in info.value.problems if p.field == field)
    assert said in problem.problem and problem.fix and "None" not in problem.problem, problem


def test_a_resume_that_changes_train_seed_is_refused_naming_train_seed_not_the_fingerprint():
    from entrypoint.checkpoint import resume as rs

    saved = rs.run_config(build_config([{}], require_paths=False))
    current = rs.run_config(build_config([{"train": {"seed": 7}}], require_paths=False))
    changed = rs.changes(saved, current, {"sha256": "before"}, {"sha256": "after"})   # the seed changes the corpus
    assert [c.key for c in changed] == ["train.seed"]
    with pytest.raises(rs.ResumeRefused) as info:
        rs.check(changed, [], "step-00000002")
    assert "train.seed: 0 -> 7" in str(info.value) and "data.fingerprint" not in str(info.value)
    assert "checkpoint.allow_changed=[train.seed]" in info.value.fix
    assert rs.check(changed, ["train.seed"], "step-00000002") == changed and rs.stream_changed(changed)
    # the data files changed under the same config: then the fingerprint is the change to name
    assert [c.key for c in rs.changes(saved, saved, {"sha256": "a"}, {"sha256": "b"})] == ["data.fingerprint"]
    with pytest.raises(ConfigError):
        build_config([{"checkpoint": {"allow_changed": ["train.sed"]}}], require_paths=False)
    build_config([{"checkpoint": {"allow_changed": ["train.seed"]}}], require_paths=False)
