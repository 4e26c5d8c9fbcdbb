"""Engine tier: verify inside the smoke image fails closed, and measures the packing leak on CPU."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.engine


def test_verify_fails_closed_with_a_readable_table(engine, smoke_image):
    result = engine.run(smoke_image, ["verify"], network="none", timeout=900)
    assert result.exit_code == 2, result.output[-3000:]
    header = next(line for line in result.output.splitlines() if line.startswith("CHECK"))
    for column in ("CHECK", "STATUS", "DETAIL", "FIX"):
        assert column in header
    assert "no CUDA device" in result.output
    assert "torch reference path" in result.output   # dispatch detected the fallback
    assert "Traceback" not in result.output


def test_cpu_isolation_probe_reports_the_leak_per_layer_kind(engine, smoke_image):
    result = engine.run(smoke_image, ["verify", "--device", "cpu", "--checks", "isolation", "--json"],
                        network="none", timeout=900)
    assert result.exit_code == 2, result.output[-3000:]
    report = json.loads(result.output[result.output.index("{"):result.output.rindex("}") + 1])
    assert report["worst"] == "FAIL" and report["exit_code"] == 2
    rows = {row["check"]: row for row in report["results"]}
    assert rows["lock"]["status"] == "PASS"          # the image's own lock was read
    assert rows["isolation.gdn"]["status"] == "FAIL"
    assert rows["isolation.conv"]["status"] == "FAIL"
    for kind in ("isolation.gdn", "isolation.conv"):
        data = rows[kind]["data"]
        assert data["packed_rel"] > data["tolerance"]
        # The negative control (boundaries withheld) must differ too, or the probe is blind.
        assert data["withheld_rel"] > data["blind_threshold"]
    # Full attention on the smoke image (sdpa + packed position_ids) is measured, not assumed.
    assert rows["isolation.attention"]["data"]["withheld_rel"] > rows["isolation.attention"]["data"]["blind_threshold"]


def test_every_environment_row_of_the_smoke_image_passes(engine, smoke_image):
    """Rows that need no GPU must pass in the image the project ships (exact rows, not the exit
    code, not the summary row that hides per-package failures)."""
    from tests.fixtures.verify_rows import GPU_ROWS, environment_rows_that_do_not_pass, report_from_output

    result = engine.run(smoke_image, ["verify", "--json", "--checks", "environment"], network="none", timeout=600)
    report = report_from_output(result.output)
    assert environment_rows_that_do_not_pass(report) == []
    rows = {r["check"]: r for r in report["results"]}
    assert {"environment.torch", "environment.transformers", "environment.packages"} <= set(rows)
    assert {r for r in rows if rows[r]["status"] == "FAIL"} == GPU_ROWS
