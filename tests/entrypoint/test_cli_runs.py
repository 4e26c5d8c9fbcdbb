"""The CLI's verify gate run for real: verify's full check set in a child process, and
finetune refusing or switching to padded batches on its verdict, and a Hub dataset folder read by
that same preflight (each run takes tens of seconds on two cores, so these sit in the training
tier, not the fast one)."""
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


def test_finetune_preflight_reads_a_split_of_ultrachat_200k_as_the_hub_lays_it_out(fixture_dir, tokenizer, tmp_path):
    """data.path=<the folder> data.split=train_sft through the launcher's own preflight (--dry-run stops
    after the run plan): the corpus the workers would memory-map holds the 12 rows of the three
    train_sft shards, and nothing of the other splits."""
    import re
    from pathlib import Path

    from entrypoint.data.corpus import read_corpus
    from entrypoint.data.inspect_data import runs
    from entrypoint.launcher.run_plan import RunPlan
    from tests.fixtures.hub_datasets import ultrachat_200k, ultrachat_rows

    root = ultrachat_200k(tmp_path / "ultrachat_200k", rows_per_shard=4)
    out = tmp_path / "out"
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--allow-fallback", "--dry-run",
                        f"output.dir={out}", f"data.path={root}", "data.split=train_sft"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "[finetune] data: 12 documents" in r.stderr and "from 12 rows; bad rows: none" in r.stderr, r.stderr[-3000:]
    plan = RunPlan.read(Path(json.loads(r.stdout)["plan"]))
    assert (plan.config.data.path, plan.config.data.split) == (str(root), "train_sft")
    corpus = read_corpus(Path(plan.corpus))
    assert len(corpus) == 12 and corpus.n_rows == 12 and corpus.bad.counts == {}
    prompts, trained = [], []
    for i in range(len(corpus)):
        ids, labels = corpus.doc_tokens(i), corpus.doc_labels(i)
        prompts += re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", tokenizer.decode(ids.tolist()))
        trained += [tokenizer.decode(ids[a:b].tolist()) for a, b, on in runs(labels) if on]
    want = [row["messages"][0]["content"] for shard in range(3) for row in ultrachat_rows("train_sft", shard, 4)]
    assert sorted(prompts) == sorted(want)
    assert len(trained) == 12 and all(span.endswith(" train_sft<|im_end|>") for span in trained), trained
