"""A resume refusal names the key the user changed, never only what it changed downstream (the
corpus fingerprint), and allowing that key lets the run go on. A real 2-rank CPU run."""
from __future__ import annotations

import pytest

from tests.fixtures.chat import finetune_metrics, run_finetune

pytestmark = pytest.mark.training


def test_a_changed_train_seed_is_refused_by_name_and_applied_when_allowed(fixture_dir, tmp_path):
    out = tmp_path / "out"
    common = ("checkpoint.every=2", "output.log_every=1")
    r = run_finetune(fixture_dir, out, "train.max_steps=2", *common)
    assert r.returncode == 0, r.stderr[-3000:]

    r = run_finetune(fixture_dir, out, "train.max_steps=3", "checkpoint.allow_changed=[train.max_steps]",
                     "train.seed=7", *common)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "train.seed: 0 -> 7" in r.stderr and "data.fingerprint" not in r.stderr
    assert "checkpoint.allow_changed=[train.seed]" in r.stderr

    r = run_finetune(fixture_dir, out, "train.max_steps=3", "train.seed=7",
                     "checkpoint.allow_changed=[train.max_steps, train.seed]", *common)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "train.seed: 0 -> 7" in r.stdout and "its stream starts again from the beginning" in r.stdout
    assert [m["step"] for m in finetune_metrics(out) if m.get("kind", "train") == "train"] == [1, 2, 3]
