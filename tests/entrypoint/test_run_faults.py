"""Faults during a real CPU run: SIGTERM (docker stop, preemption), a damaged newest
checkpoint, a NaN loss, a full disk. Each ends in a clear state a rerun can continue from."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from entrypoint.checkpoint.dcp import list_checkpoints
from tests.fixtures.chat import (
    REPO,
    entrypoint_env,
    finetune_metrics,
    run_entrypoint,
    run_finetune,
)

pytestmark = pytest.mark.training


def test_sigterm_checkpoints_reports_interrupted_and_resumes(fixture_dir, tmp_path):
    out = tmp_path / "out"
    log = (tmp_path / "run.log").open("w")
    # SIGTERM goes to the launcher only, as `docker stop` sends it to PID 1
    proc = subprocess.Popen([sys.executable, "-m", "entrypoint", "finetune", "--config", str(fixture_dir.config),
                             "--allow-fallback", f"output.dir={out}", "train.max_steps=400", "checkpoint.every=0",
                             "checkpoint.export=false", "output.tensorboard=true"],
                            cwd=REPO, env=entrypoint_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not any(m["step"] >= 3 for m in finetune_metrics(out)):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, (tmp_path / "run.log").read_text()[-3000:]
    text = (tmp_path / "run.log").read_text()
    report = json.loads((out / "run_report.json").read_text())
    stopped_at = report["final_step"]
    assert report["status"] == "interrupted" and report["interrupted"] is True and 3 <= stopped_at < 400
    # checkpoint.every=0 writes no periodic checkpoints: this one is the stop's own
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step-{stopped_at:08d}"]
    assert "stop requested (SIGTERM): the workers checkpoint" in text and "Traceback" not in text
    assert f"stopped by SIGTERM after a checkpoint at step {stopped_at}" in text
    # progress lines carry elapsed time and an ETA; TensorBoard events were written beside metrics.jsonl
    assert any("elapsed" in line and "ETA" in line for line in text.splitlines() if line.startswith("[finetune] step"))
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    r = run_finetune(fixture_dir, out, f"train.max_steps={stopped_at + 2}", "checkpoint.every=0",
             "checkpoint.allow_changed=[train.max_steps]")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at:08d}'} at step {stopped_at}" in r.stdout
    report = json.loads((out / "run_report.json").read_text())
    assert report["status"] == "completed" and report["final_step"] == stopped_at + 2


def test_damaged_newest_checkpoint_is_skipped_on_resume(fixture_dir, tmp_path):
    out = tmp_path / "out"
    common = ("launch.nproc_per_node=1", "checkpoint.every=2", "checkpoint.keep=2")
    r = run_finetune(fixture_dir, out, "train.max_steps=4", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    newest = out / "checkpoints" / "step-00000004"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])   # a torn write the rename did not catch

    r = run_finetune(fixture_dir, out, "train.max_steps=6", "checkpoint.allow_changed=[train.max_steps]", *common)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "WARNING: skipping checkpoint step-00000004: step-00000004 is damaged" in r.stdout
    assert f"resumed from {out / 'checkpoints' / 'step-00000002'} at step 2" in r.stdout


def test_a_checkpoint_whose_state_lies_is_refused_or_skipped_never_trained_from(fixture_dir, tmp_path):
    """trainer_state.json says step -4 (the folder is step 4): a resume pointed at it is refused
    before any rank starts (exit 2, the fix); resume=auto skips it for the newest valid one, here on
    fewer ranks than saved it, and every checkpoint the resumed run writes validates."""
    from entrypoint.checkpoint.dcp import TRAINER_STATE, read_state
    from tests.fixtures.checkpoints import edit_json

    out = tmp_path / "out"
    common = ("checkpoint.every=2", "checkpoint.keep=3")
    r = run_finetune(fixture_dir, out, "train.max_steps=4", "launch.nproc_per_node=2", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    newest = out / "checkpoints" / "step-00000004"
    edit_json(newest / TRAINER_STATE, lambda state: state.update(step=-4))

    r = run_finetune(fixture_dir, out, f"checkpoint.resume={newest}", "train.max_steps=6",
                     "checkpoint.allow_changed=[train.max_steps]", "launch.nproc_per_node=1", *common)
    log = r.stdout + r.stderr
    assert r.returncode == 2, log[-3000:]
    assert "step-00000004 is damaged: trainer_state.json: step: -4 is out of range (allowed: an integer >= 0" in log
    assert "fix: resume=auto skips it" in log and "Traceback" not in log and "launching:" not in log

    r = run_finetune(fixture_dir, out, "train.max_steps=6", "checkpoint.allow_changed=[train.max_steps]",
                     "launch.nproc_per_node=1", *common)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "WARNING: skipping checkpoint step-00000004: step-00000004 is damaged: trainer_state.json: step" in r.stdout
    assert f"resumed from {out / 'checkpoints' / 'step-00000002'} at step 2" in r.stdout and "Traceback" not in log
    assert json.loads((out / "run_report.json").read_text())["final_step"] == 6
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000004", "step-00000006"], names   # no step--0000004
    for path in list_checkpoints(out / "checkpoints"):
        state = read_state(path)   # what the resumed run saved validates (it re-saved step 4 whole)
        assert state.step == int(path.name[5:]) and state.sampler.position <= state.step * state.max_step_items
    assert read_state(out / "checkpoints" / "step-00000006").max_step_items == 2   # the widest step: 2 ranks


def test_non_finite_gradients_stop_the_run_before_the_optimizer_steps(fixture_dir, tmp_path):
    out = tmp_path / "out"
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--allow-fallback", f"output.dir={out}",
                        "train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0", "train.max_steps=20",
                        "checkpoint.every=1"], timeout=240)
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-3000:]
    assert log.count("ERROR: the gradient norm became") == 1 and "fix:" in log and "Traceback" not in log
    assert not (out / "final").exists()
    report = json.loads((out / "run_report.json").read_text())
    assert report["status"] == "failed" and "the gradient norm became" in report["error"]
    stopped_at = int(report["error"].split(" at step ")[1].split(";")[0])
    # every checkpoint written holds finite weights: the step whose gradients were not finite never stepped
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = list_checkpoints(out / "checkpoints")
    assert saved and int(saved[-1].name.split("-")[1]) == stopped_at - 1
    for ckpt in saved:
        dcp_to_torch_save(str(ckpt), str(tmp_path / "c.pt"))
        state = torch.load(tmp_path / "c.pt", weights_only=True)["model"]
        assert all(torch.isfinite(t).all() for t in state.values()), ckpt.name


@pytest.fixture
def small_volume(tmp_path):
    """A 3 MiB tmpfs: the tiny model's checkpoint (weights + Adam state, ~10 MB) cannot fit."""
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs and needs root (CI runs as root)")
    mount = tmp_path / "vol"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_is_one_error_and_leaves_no_partial_checkpoint(fixture_dir, small_volume):
    r = run_finetune(fixture_dir, small_volume, "train.max_steps=4", "checkpoint.every=2")
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-3000:]
    assert log.count("ERROR: no space left on the device while writing") == 1, log[-3000:]
    assert "free space on that volume" in log and "Traceback" not in log
    ckpts = small_volume / "checkpoints"
    assert not [p for p in ckpts.iterdir()] if ckpts.exists() else True   # no half-written step, no .tmp-*
    report = json.loads((small_volume / "run_report.json").read_text())
    assert report["status"] == "failed" and "no space left" in report["error"]
