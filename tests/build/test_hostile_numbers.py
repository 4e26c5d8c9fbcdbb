"""Numbers, sizes and echoed secrets, tried as an attacker would."""
from __future__ import annotations

import pytest

from tests.conftest import run_build_cli
from tests.fixtures.chat import run_entrypoint

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value", ["garbage", "-5", "1e20", "", "100000000000000000000", "253402300800", "²",
                                   " 17", "0x10"])
def test_a_bad_source_date_epoch_is_exit_2_never_a_silent_fallback(value):
    proc = run_build_cli("images/smoke", "--plan", env={"SOURCE_DATE_EPOCH": value})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "SOURCE_DATE_EPOCH" in proc.stderr and "fix:" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("value, epoch", [("0", 0), ("1700000000", 1700000000), ("4294967296", 4294967296)])
def test_a_good_source_date_epoch_is_used(value, epoch):
    from build.source_date import parse_epoch

    assert parse_epoch(value) == epoch


def test_problem_collection_is_linear():
    """95k unknown keys used to take ~20 minutes (a list scan per problem)."""
    from contracts.schema import Problems

    problems = Problems()
    comparisons = 0

    class Counting(str):
        def __eq__(self, other):
            nonlocal comparisons
            comparisons += 1
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    for i in range(20000):
        problems.add("f", Counting(f"train.k{i}"), "unknown field", "remove it")
    problems.add("f", "train.k1", "unknown field", "remove it")   # a duplicate is still dropped
    assert len(problems) == 20000 and comparisons < 40000


def test_a_config_with_95k_unknown_keys_is_rejected_with_the_first_ones_shown(tmp_path):
    config = tmp_path / "big.yaml"
    config.write_text("train:\n" + "".join(f" {i:x}: 1\n" for i in range(95000)))
    r = run_entrypoint(["finetune", "--config", str(config), "--print-config"], timeout=120)
    assert r.returncode == 2 and "unknown field" in r.stderr and "94950 more problem(s)" in r.stderr
    assert len(r.stderr.splitlines()) < 200 and "Traceback" not in r.stderr


@pytest.mark.parametrize("url, secret", [
    ("https://alice:s3cr3t@files.example.com/pkg/causal_conv1d-1.7.0.tar.gz", "s3cr3t"),
    ("https://files.example.com/pkg/causal_conv1d-1.7.0.tar.gz?token=s3cr3t", "s3cr3t"),
    ("http://files.example.com/hf_s3cr3tS3CR3Ts3cr3tS3CR3Tx/causal_conv1d-1.7.0.tar.gz", "s3cr3t"),
])
def test_errors_that_echo_a_url_mask_its_secrets(tmp_path, url, secret):
    import yaml

    from tests.conftest import REPO_ROOT

    manifest = yaml.safe_load((REPO_ROOT / "kernels_manifest.yaml").read_text())
    manifest["kernels"]["causal-conv1d"]["source"]["sdist"]["url"] = url
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(manifest))
    proc = run_build_cli("images/kernel-smoke", "--plan", "--manifest", str(tmp_path / "m.yaml"))
    assert proc.returncode == 2 and "url" in proc.stderr
    assert secret not in proc.stderr and secret not in proc.stdout and "***" in proc.stderr


def test_a_push_reference_with_credentials_is_refused_without_echoing_them():
    from build.publish.reference import reference_problems

    problems = reference_problems("alice:s3cr3t@registry.example.com:5000/team/qwen27b")
    assert len(problems) == 1 and "credentials" in problems[0].problem and "s3cr3t" not in problems[0].problem
    assert "docker login" in problems[0].fix
