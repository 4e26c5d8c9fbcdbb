"""The CLI's verify gate run for real: verify's full check set in a child process, and
finetune refusing or switching to padded batches on its verdict (each run takes tens of seconds
on two cores, so these sit in the training tier, not the fast one)."""
from __future__ import annotations

import json

import pytest

from tests.fixtures.chat import entrypoint_env, run_entrypoint

pytestmark = pytest.mark.training


def test_gate_fails_closed_without_allow_fallback(fixture_dir, tmp_path):
    # No lock in this environment: verify's lock row FAILs, so finetune must refuse.
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), f"output.dir={tmp_path}"])
    assert r.returncode == 3, r.stdout + r.stderr
    assert "verify did not pass" in r.stderr and "--allow-fallback" in r.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_allow_fallback_switches_to_padded_and_is_recorded(fixture_dir, tmp_path):
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), f"output.dir={tmp_path}", "--dry-run"],
                       env=entrypoint_env(FTIMAGE_ALLOW_FALLBACK="1"))
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / ".launch" / "plan-node0.json").read_text())
    assert plan["allow_fallback"] is True
    assert plan["packing"]["requested"] == "packed" and plan["packing"]["effective"] == "padded"
    assert plan["config"]["packing"]["mode"] == "padded"
    assert plan["verify"]["passed"] is False
    argv = json.loads(r.stdout)["argv"]
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert "--rdzv-backend" in argv and argv[argv.index("--rdzv-backend") + 1] == "static"
    assert argv[argv.index("--master-addr") + 1] == "127.0.0.1"


def test_the_gate_runs_verify_in_a_child_process(monkeypatch, tmp_path):
    """verify's probes initialise CUDA; in the launcher that context (and GPU memory) would stay
    held for the whole run, so the launcher never imports the checks itself."""
    import sys

    from entrypoint.launcher.verify_gate import run_verify
    from tests.fixtures.locks import environment_lock

    lock = tmp_path / "lock.json"
    lock.write_text(environment_lock().to_json())
    monkeypatch.setenv("FTIMAGE_LOCK", str(lock))
    before = {m for m in sys.modules if m.startswith("verify.checks")}
    outcome = run_verify()
    assert {m for m in sys.modules if m.startswith("verify.checks")} == before
    rows = {r["check"]: r["status"] for r in outcome.report["results"]}
    assert not outcome.passed and rows["lock"] == "PASS" and rows["environment.cuda_device"] == "FAIL"
    assert "CHECK" in outcome.table and "dispatch.causal_conv1d_fn" in outcome.table
