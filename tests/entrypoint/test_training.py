"""Real multi-process FSDP2 training on CPU (gloo) with the tiny Qwen3.5 fixture."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from entrypoint.checkpoint.dcp import MARKER, is_complete, list_checkpoints
from entrypoint.launcher.preflight import prepare
from entrypoint.launcher.torchrun import free_port
from entrypoint.launcher.verify_gate import GateOutcome
from tests.fixtures.chat import entrypoint_env, run_entrypoint
from tests.fixtures.processes import descendants

pytestmark = pytest.mark.training


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in _metrics(out)}


def _passing_gate(**_verify_args) -> GateOutcome:
    # verify fails closed on CPU (torch fallback kernels), so training on packed rows can
    # only be exercised here by standing in for a passing verify. The CLI never does this.
    return GateOutcome(passed=True, worst="PASS", table="(test stand-in for a passing verify)",
                       report={"stand_in": True, "passed": True})


def _launch_packed(config: Path, out: Path, *overrides: str, pythonpath: str = "", **popen) -> subprocess.Popen:
    env = entrypoint_env()
    if pythonpath:     # e.g. the kernel test doubles, importable by every rank
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env['PYTHONPATH']}"
    launch = prepare(config_file=str(config), overrides=[f"output.dir={out}", *overrides], allow_fallback=False,
                     env=env, log=lambda m: None, gate=_passing_gate)
    assert launch.plan.packing.effective == "packed"
    return subprocess.Popen(launch.argv, env=launch.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


def _kill_tree(pid: int) -> None:
    """SIGKILL the agent and every worker at once, like a node dying. torchrun starts its
    workers in their own sessions, so a process-group kill would leave them running."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def test_fallback_run_trains_pads_records_and_exports(fixture_dir, tmp_path):
    out = tmp_path / "out"
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--allow-fallback", f"output.dir={out}",
                        "checkpoint.export_dtype=float32"], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # loud on every rank
    assert r.stderr.count("WARNING: --allow-fallback") == 2
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1] - 1.0, losses
    report = json.loads((out / "run_report.json").read_text())
    assert report["status"] == "completed" and report["allow_fallback"] is True
    assert report["packing"]["effective"] == report["packing_mode"] == "padded"
    assert report["verify"]["passed"] is False
    # the planted bad rows (conftest.BAD_ROWS) are counted, reported and did not stop the run
    assert report["bad_rows"]["by_reason"] == {"invalid_json": 1, "missing_messages": 1}
    assert report["bad_rows"]["truncated"] == 1 and report["rows_read"] == 259 and report["documents"] == 257
    assert "bad rows: {'invalid_json': 1, 'missing_messages': 1}, truncated: 1" in r.stdout
    assert report["final_step"] == 10
    assert report["final_loss"] == pytest.approx(losses[10])
    m = _metrics(out)[-1]
    for key in ("tokens_per_s", "padding_ratio", "packing_efficiency", "data_time_s", "compute_time_s", "mfu",
                "peak_rss_gib"):
        assert key in m
    assert m["padding_ratio"] > 0.05  # 2D padded rows really carry padding

    # the export is the trained model: equal to the final DCP checkpoint, loadable by HF
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    final_ckpt = list_checkpoints(out / "checkpoints")[-1]
    assert final_ckpt.name == "step-00000010"
    dcp_to_torch_save(str(final_ckpt), str(tmp_path / "ckpt.pt"))
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    exported = load_file(str(out / "final" / "model.safetensors"))
    assert set(exported) == set(ckpt)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, ckpt[name], rtol=0, atol=0)
    initial = load_file(str(fixture_dir.model_dir / "model.safetensors"))
    assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], exported["model.layers.0.mlp.up_proj.weight"])
    model = AutoModelForCausalLM.from_pretrained(str(out / "final"))
    torch.testing.assert_close(model.state_dict()["lm_head.weight"], exported["lm_head.weight"])


def test_packed_run_fills_rows_and_loss_falls(fixture_dir, tmp_path):
    out = tmp_path / "out"
    log = _finish(_launch_packed(fixture_dir.config, out, "parallel.param_dtype=bfloat16",
                                 "parallel.activation_checkpoint=full", "checkpoint.export=false",
                                 "train.max_steps=8", "output.profile_steps=3:5"))
    assert (out / "profile" / "trace-rank0.json").is_file() and (out / "profile" / "trace-rank1.json").is_file()
    assert "aten ops per step:" in log
    losses = _losses(out)
    assert losses[8] < losses[1] - 1.0, losses
    report = json.loads((out / "run_report.json").read_text())
    assert report["allow_fallback"] is False and report["packing"]["effective"] == "packed"
    # packed rows are nearly full (windows end with one part-filled row); padded ones are not
    eff = [m["packing_efficiency"] for m in _metrics(out)]
    assert sum(eff) / len(eff) > 0.85, eff


def test_kill_9_then_resume_matches_uninterrupted(fixture_dir, tmp_path):
    common = ("train.max_steps=12", "checkpoint.every=3", "checkpoint.keep=2", "checkpoint.export=false",
              "parallel.activation_checkpoint=selective")
    base = tmp_path / "base"
    _finish(_launch_packed(fixture_dir.config, base, *common))
    want = _losses(base)

    out = tmp_path / "killed"
    proc = _launch_packed(fixture_dir.config, out, *common)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and any(m["step"] >= 7 for m in _metrics(out)):
            break
        assert proc.poll() is None, "run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
        time.sleep(0.02)
    _kill_tree(proc.pid)
    proc.wait(timeout=30)
    killed_at = max(_losses(out))
    assert killed_at < 12, "the kill came too late to test resume"

    ckpts = out / "checkpoints"
    # whatever the kill interrupted, only complete checkpoints carry a step-* name
    for p in ckpts.iterdir():
        if p.name.startswith("step-"):
            assert is_complete(p, world_size=2), f"{p} looks valid but is incomplete"
    # plant what a killed writer leaves (a marked, half-written temp dir), a torn step dir, and a
    # temp-looking folder this tool did not make (never deleted)
    (ckpts / ".tmp-step-00000099").mkdir()
    (ckpts / ".tmp-step-00000099" / MARKER).write_text("{}")
    (ckpts / ".tmp-step-00000099" / "__0_0.distcp").write_bytes(b"\0" * 10)
    (ckpts / ".tmp-not-ours").mkdir()
    (ckpts / "step-00000098").mkdir()
    (ckpts / "step-00000098" / ".metadata").write_bytes(b"torn")
    resume_from = list_checkpoints(ckpts)[-1]
    resume_step = int(resume_from.name.split("-")[1])
    assert 6 <= resume_step <= killed_at

    log = _finish(_launch_packed(fixture_dir.config, out, *common))
    assert f"resumed from {resume_from}" in log
    assert not (ckpts / ".tmp-step-00000099").exists() and (ckpts / ".tmp-not-ours").is_dir()
    report = json.loads((out / "run_report.json").read_text())
    assert report["resumed_from"] == str(resume_from) and report["final_step"] == 12
    # keep=2: only the two newest complete checkpoints remain (the planted torn dir never counts)
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-00000009", "step-00000012"]
    steps = [m["step"] for m in _metrics(out)]
    assert steps == sorted(set(steps)) and steps[-1] == 12   # each step once, though steps after the
    #                                                         checkpoint were logged before the kill too
    got = {m["step"]: m["loss"] for m in _metrics(out) if m["step"] > resume_step}
    assert sorted(got) == list(range(resume_step + 1, 13))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], abs=1e-4), (step, loss, want[step])


def test_two_node_run_on_loopback(fixture_dir, tmp_path):
    out = tmp_path / "out"
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = entrypoint_env(NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                             GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "entrypoint", "finetune", "--config", str(fixture_dir.config),
             "--allow-fallback", f"output.dir={out}", "launch.nproc_per_node=1", "train.max_steps=6",
             "checkpoint.every=3", "checkpoint.export=false"],
            env=env, cwd=Path(__file__).resolve().parents[2], stdout=(tmp_path / f"node{node}.log").open("w"),
            stderr=subprocess.STDOUT, text=True))
    # logs go to files, not pipes: reading one node's pipe to the end while the other node's
    # pipe fills would block that node inside a collective and hang both
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:     # a node stuck in rendezvous must not outlive the test
            if p.poll() is None:
                p.kill()
    for node, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"node{node}.log").read_text()[-3000:]
    for node in (0, 1):
        plan = json.loads((out / ".launch" / f"plan-node{node}.json").read_text())
        assert plan["topology"]["nnodes"] == 2 and plan["topology"]["node_rank"] == node
    report = json.loads((out / "run_report.json").read_text())
    assert report["world_size"] == 2 and report["final_step"] == 6
    losses = _losses(out)
    assert losses[6] < losses[1], losses
    assert is_complete(out / "checkpoints" / "step-00000006", world_size=2)


def test_loss_is_normalised_by_global_tokens(fixture_dir, tmp_path):
    """2 ranks x 1 micro-batch and 1 rank x 2 micro-batches see the same micro-batches per
    step (sampler.py), so with a GLOBAL token count and FSDP's averaging undone, both must
    follow the same loss curve. A per-rank mean would weight the two halves differently."""
    common = ("train.max_steps=5", "checkpoint.export=false", "checkpoint.every=0")
    two = tmp_path / "two"
    _finish(_launch_packed(fixture_dir.config, two, *common))
    one = tmp_path / "one"
    _finish(_launch_packed(fixture_dir.config, one, *common, "launch.nproc_per_node=1", "train.grad_accum=2"))
    a, b = _losses(two), _losses(one)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=2e-4), (step, a, b)
    assert a[5] < a[1]
    # AdamW hides a uniform gradient scale; the pre-clip grad norm does not
    ga = {m["step"]: m["grad_norm"] for m in _metrics(two)}
    gb = {m["step"]: m["grad_norm"] for m in _metrics(one)}
    assert ga[1] == pytest.approx(gb[1], rel=1e-4)


def test_unusable_data_fails_with_a_fix_and_a_report(fixture_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": []}\n{"text": "wrong shape"}\n')
    out = tmp_path / "out"
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--allow-fallback", f"data.path={data}",
                        f"output.dir={out}", "launch.nproc_per_node=1"], timeout=240)
    log = r.stdout + r.stderr
    # the data is tokenized once before any rank starts, so unusable data stops the run
    # there: one error with a fix, no workers launched, no traceback
    assert r.returncode == 2, log[-3000:]
    assert "error: no usable rows" in log and "empty_messages" in log and "missing_messages" in log
    assert "fix:" in log and "launching" not in log and "Traceback" not in log
    assert not (out / "checkpoints").exists()
