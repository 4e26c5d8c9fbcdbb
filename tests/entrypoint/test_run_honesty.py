"""A run that tells the truth: Ctrl-C saves work, resume refuses what it would silently ignore,
one JSON stream, trackers that get every loss, and an end-of-run summary. Real 2-rank CPU runs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from entrypoint.checkpoint.dcp import list_checkpoints
from tests.fixtures.chat import (
    entrypoint_env,
    finetune_metrics,
    run_entrypoint,
    run_finetune,
    start_finetune_in_session,
)
from tests.fixtures.trackers import mlflow_losses, tensorboard_losses, wandb_losses

pytestmark = pytest.mark.training


def _tree(out: Path) -> dict[str, tuple[float, int]]:
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*")
            if p.is_file()}


def _wait_for_step(proc, out: Path, step: int, log: Path) -> None:
    deadline = time.monotonic() + 180
    while not any(m["step"] >= step for m in finetune_metrics(out)):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def test_ctrl_c_checkpoints_exits_130_quietly_and_the_rerun_resumes(fixture_dir, tmp_path):
    out = tmp_path / "out"
    log = (tmp_path / "run.log").open("w")
    # a terminal's Ctrl-C: SIGINT to the launcher's whole process group
    proc = start_finetune_in_session(fixture_dir, out, log, "train.max_steps=400", "checkpoint.every=20",
                                     "output.log_every=1")
    _wait_for_step(proc, out, 12, tmp_path / "run.log")
    lines_before = len((tmp_path / "run.log").read_text().splitlines())
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, (tmp_path / "run.log").read_text()[-3000:]
    text = (tmp_path / "run.log").read_text()
    report = json.loads((out / "run_report.json").read_text())
    stopped = report["final_step"]
    assert report["status"] == "interrupted" and report["interrupted"] is True and report["stop_signal"] == "SIGINT"
    assert 12 <= stopped <= 15   # the step in flight, or the next: never a step cut in half
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step-{stopped:08d}"]   # not a multiple of 20
    after = [line for line in text.splitlines()[lines_before:] if not line.startswith("[finetune] step ")]
    assert len(after) <= 3 and "Traceback" not in text and "KeyboardInterrupt" not in text, after
    assert f"stopped by SIGINT after a checkpoint at step {stopped}" in text

    r = run_finetune(fixture_dir, out, "checkpoint.every=20", f"train.max_steps={stopped + 1}",
                  "checkpoint.allow_changed=[train.max_steps]")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped:08d}'} at step {stopped}" in r.stdout
    steps = [m["step"] for m in finetune_metrics(out)]
    assert len(steps) == len(set(steps))   # unique after the restart


def test_resume_refuses_a_changed_key_applies_an_allowed_one_and_a_finished_run_changes_nothing(fixture_dir,
                                                                                               tmp_path):
    out = tmp_path / "out"
    common = ("train.max_steps=4", "checkpoint.every=2", "output.log_every=1")
    r = run_finetune(fixture_dir, out, *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("[finetune] done: step 4")

    before = _tree(out)
    r = run_finetune(fixture_dir, out, *common)
    assert r.returncode == 0 and "already complete" in r.stderr, r.stderr[-2000:]
    assert _tree(out) == before   # nothing written: no verify, no tokenizing, no report, no export

    r = run_finetune(fixture_dir, out, *common, "train.lr=1e-3")
    assert r.returncode == 2 and "train.lr: 0.003 -> 0.001" in r.stderr and "Traceback" not in r.stderr
    assert "fresh output.dir" in r.stderr and "checkpoint.allow_changed=[train.lr]" in r.stderr
    assert _tree(out) == before

    r = run_finetune(fixture_dir, out, "train.max_steps=6", "checkpoint.every=2", "output.log_every=1",
                  "train.lr=1e-3", "checkpoint.allow_changed=[train.lr, train.max_steps]")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoint.allow_changed: train.lr: 0.003 -> 0.001" in r.stdout
    assert "schedule was rebuilt from step 4" in r.stdout
    lrs = {m["step"]: m["lr"] for m in finetune_metrics(out)}
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    expected = get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6,
                                                           min_lr_rate=0.1)
    for step in range(1, 7):
        opt.step()      # the order training uses (and torch expects); the SGD has no gradient to apply
        expected.step()
        if step >= 5:
            assert lrs[step] == pytest.approx(expected.get_last_lr()[0], rel=1e-6), (step, lrs)
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6]   # the first run's steps, then the resumed ones, each once


def test_one_json_stream_trackers_epochs_and_the_summary(fixture_dir, tmp_path):
    out = tmp_path / "out"
    env = entrypoint_env(WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    r = run_entrypoint(["finetune", "--json-logs", "--config", str(fixture_dir.config), "--allow-fallback",
                        f"output.dir={out}", "checkpoint.export=false", "train.max_steps=1000", "train.epochs=1",
                        "output.log_every=1", "output.report_to=[tensorboard, wandb, mlflow]"],
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    not_json = []
    for line in lines:
        try:
            event = json.loads(line)
            assert isinstance(event, dict) and {"phase", "msg"} <= set(event)
        except (ValueError, AssertionError):
            not_json.append(line)
    assert not_json == [] and len(lines) > 20, not_json[:5]
    phases = {json.loads(line)["phase"] for line in lines}
    assert {"finetune", "train", "summary"} <= phases
    summary = next(json.loads(line) for line in lines if json.loads(line)["phase"] == "summary")
    for key in ("wall_seconds", "time_to_first_step_seconds", "tokens_trained", "mean_tokens_per_s", "mfu",
                "peak_rss_gib"):
        assert key in summary, key

    # train.epochs=1 ended the run at the end of the first epoch, well before max_steps
    report = json.loads((out / "run_report.json").read_text())
    metrics = finetune_metrics(out)
    assert report["final_step"] == report["total_steps"] == metrics[-1]["step"] < 1000
    assert {m["epoch"] for m in metrics} == {0}
    assert report["summary"]["tokens_trained"] > 0 and report["summary"]["steps_this_run"] == report["final_step"]

    losses = {m["step"]: m["loss"] for m in metrics}
    for name, read in (("tensorboard", tensorboard_losses), ("wandb", wandb_losses), ("mlflow", mlflow_losses)):
        got = read(out)
        assert sorted(got) == sorted(losses), name
        assert all(got[s] == pytest.approx(losses[s], rel=1e-6) for s in losses), name


def test_a_second_ctrl_c_stops_at_once_and_says_nothing_more_was_saved(fixture_dir, tmp_path):
    out = tmp_path / "out"
    log = (tmp_path / "run.log").open("w")
    proc = start_finetune_in_session(fixture_dir, out, log, "train.max_steps=400", "checkpoint.every=0",
                                     "output.log_every=1")
    _wait_for_step(proc, out, 2, tmp_path / "run.log")
    os.killpg(proc.pid, signal.SIGINT)
    text, deadline = "", time.monotonic() + 180
    while "Ctrl-C again" not in text:
        assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
        time.sleep(0.01)
        text = (tmp_path / "run.log").read_text()
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    text = (tmp_path / "run.log").read_text()
    assert "stopped at once by a second Ctrl-C: nothing more was saved" in text and "Traceback" not in text
    workers = subprocess.run(["pgrep", "-f", f"entrypoint.train --plan {out}"], capture_output=True, text=True)
    assert workers.stdout.strip() == ""    # no worker lives on
