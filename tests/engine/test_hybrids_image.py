"""The CPU twin of the hybrids image (images/hybrids-cpu: every hybrid family, no fused kernels),
built as a user builds it: verify inside it, and the audit of it, give each family's rows, row by
row: the torch fallback named with its real import error, each layer kind's leak measured, and the
MoE experts' grouped path; a model it does not cover is refused, naming what it covers."""
from __future__ import annotations

import json

import pytest

from families import load_family
from tests.conftest import run_build_cli

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def hybrids_cpu(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrids-cpu-out")
    proc = run_build_cli("images/hybrids-cpu", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    yield report["tag"]
    engine.remove(report["tag"])


@pytest.fixture(scope="session")
def families_in_image(engine, hybrids_cpu) -> list[str]:
    labels = engine.image(hybrids_cpu)["Config"]["Labels"]
    return labels["io.ftimage.model-family"].split(",")


def assert_family_rows(rows: dict, family: str) -> None:
    fam = load_family(family)
    for fused in fam.fused_functions:
        row = rows[f"dispatch.{family}.{fused.function}"]
        assert row["status"] == "FAIL" and "torch reference path" in row["detail"], row
        assert "is not installed" in row["detail"] and fused.boundary_kwarg in row["detail"], row
    for what in {m for kind in fam.layer_kinds.values() for m in kind.measure}:
        row = rows[f"isolation.{family}.{what}"]
        assert row["data"]["withheld_rel"] > row["data"]["blind_threshold"], row
        if what != "attention":
            assert row["status"] == "FAIL" and "leak:" in row["detail"], row
    if fam.experts is not None:
        row = rows[f"dispatch.{family}.experts"]
        assert row["status"] == "PASS" and "grouped_mm ran" in row["detail"], row


def test_the_image_holds_every_hybrid_family(families_in_image):
    assert len(families_in_image) >= 9 and "granitemoehybrid" in families_in_image and "kimi_linear" in \
        families_in_image


def test_verify_in_the_image_gives_each_family_s_rows(engine, hybrids_cpu, families_in_image):
    result = engine.run(hybrids_cpu, ["verify", "--device", "cpu", "--checks", "dispatch,isolation", "--json"],
                        network="none", timeout=1800)
    assert result.exit_code == 2, result.output[-3000:]          # no kernels: fail closed
    rows = {r["check"]: r for r in json.loads(result.stdout)["results"]}
    for family in families_in_image:
        assert_family_rows(rows, family)


def test_the_audit_of_the_image_gives_each_family_s_rows(hybrids_cpu, families_in_image):
    proc = run_build_cli("audit", hybrids_cpu, "--json", "--families", ",".join(families_in_image), timeout=1800)
    assert proc.returncode == 2, proc.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads(proc.stdout)["results"]}
    assert rows["lock"]["status"] == "SKIP"
    for family in families_in_image:
        assert_family_rows(rows, family)


def test_a_model_no_family_covers_is_refused_naming_what_the_image_covers(engine, hybrids_cpu, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "num_attention_heads": 2}))
    tmp_path.chmod(0o755)     # the image's user reads the mount
    result = engine.run(hybrids_cpu, ["verify", "--device", "cpu", "--checks", "model_fit", "--model", "/model",
                                      "--json"], network="none", timeout=600,
                        volumes={str(tmp_path): {"bind": "/model", "mode": "ro"}})
    rows = {r["check"]: r for r in json.loads(result.stdout)["results"]}
    assert "model_family" in rows, {k: v["detail"][:150] for k, v in rows.items()}
    row = rows["model_family"]
    assert row["status"] == "FAIL" and "not covered: model_type llama" in row["detail"]
    assert "granitemoehybrid" in row["detail"] and "qwen3_5_text" in row["detail"]
