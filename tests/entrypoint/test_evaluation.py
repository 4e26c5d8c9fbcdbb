"""Evaluation: a held-out loss at a cadence, reproducible from a checkpoint, early stopping that
keeps the best checkpoint, and greedy samples written by every rank in lockstep."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from entrypoint.checkpoint.dcp import list_checkpoints
from entrypoint.launcher.preflight import prepare
from entrypoint.launcher.verify_gate import GateOutcome
from tests.fixtures.chat import entrypoint_env, run_entrypoint


def _passing_gate(**_):
    return GateOutcome(passed=True, worst="PASS", table="(test stand-in)", report={})


@pytest.mark.unit
@pytest.mark.slow
def test_evaluating_the_same_checkpoint_gives_the_same_loss(fixture_dir, tmp_path):
    from entrypoint.trainer import Trainer

    launch = prepare(config_file=str(fixture_dir.config), allow_fallback=False, env=entrypoint_env(),
                     log=lambda m: None, gate=_passing_gate,
                     overrides=[f"output.dir={tmp_path / 'out'}", "data.eval_fraction=0.1", "train.eval_every=2",
                                "launch.nproc_per_node=1"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        trainer = Trainer.build(launch.plan.config, launch.plan, 0, 1, torch.device("cpu"))
        for _ in range(2):
            trainer.step += 1
            trainer.pending.append(trainer.train_step().pending)
        first, tokens = trainer.evaluator.loss(trainer.model)
        again, _ = trainer.evaluator.loss(trainer.model)
        assert tokens > 0 and first == pytest.approx(again, abs=1e-6)
        trainer.save()
        fresh = Trainer.build(launch.plan.config, launch.plan, 0, 1, torch.device("cpu"))
        fresh.resume()
        reloaded, _ = fresh.evaluator.loss(fresh.model)
        assert fresh.step == 2 and reloaded == pytest.approx(first, abs=1e-6)
        untrained = Trainer.build(launch.plan.config, launch.plan, 0, 1, torch.device("cpu"))
        assert untrained.evaluator.loss(untrained.model)[0] != pytest.approx(first, abs=1e-6)   # it depends on weights
    finally:
        dist.destroy_process_group()


def _records(out: Path, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m.get("kind", "train") == kind]


@pytest.mark.training
def test_eval_cadence_early_stopping_best_checkpoint_and_samples(fixture_dir, tmp_path):
    out = tmp_path / "out"
    # a learning rate too small to move fp32 weights: every eval after the first is no better
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--allow-fallback", f"output.dir={out}",
                        "train.max_steps=20", "train.lr=1e-30", "train.warmup_steps=0", "data.eval_fraction=0.1",
                        "train.eval_every=2", "train.early_stopping_patience=2", "checkpoint.every=1",
                        "checkpoint.keep=1", "checkpoint.keep_best=true", "eval.samples=3", "eval.max_new_tokens=4",
                        "output.report_to=[tensorboard]", "checkpoint.export=false"], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = _records(out, "eval")
    assert [m["step"] for m in evals] == [2, 4, 6]          # the cadence, then patience 2 ran out
    assert len({round(m["eval_loss"], 9) for m in evals}) == 1 and evals[0]["eval_tokens"] > 0
    report = json.loads((out / "run_report.json").read_text())
    assert report["status"] == "early_stopped" and report["final_step"] == 6
    assert report["best_step"] == 2 and report["best_eval_loss"] == pytest.approx(evals[0]["eval_loss"])
    assert report["summary"]["best_eval_loss"] == pytest.approx(evals[0]["eval_loss"])
    assert "early stopping: 2 evaluations without a better eval loss" in r.stdout
    # keep=1 keeps the newest; keep_best keeps step 2 beside it
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-00000002", "step-00000006"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 9 and {s["step"] for s in samples} == {2, 4, 6}
    assert all(s["prompt"].endswith("<|im_start|>assistant\n") and s["reference"] for s in samples)
    from tests.fixtures.trackers import tensorboard_losses

    assert sorted(tensorboard_losses(out, "eval/loss")) == [2, 4, 6]
