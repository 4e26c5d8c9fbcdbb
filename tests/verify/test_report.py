import json

import pytest

from verify.report import CheckResult, Report, Status

pytestmark = pytest.mark.unit


def _row(status, check="x"):
    return CheckResult(check, status, "detail", "" if status in (Status.PASS, Status.SKIP) else "the fix")


@pytest.mark.parametrize("statuses, worst, code", [
    ([Status.PASS], Status.PASS, 0),
    ([Status.PASS, Status.SKIP], Status.PASS, 0),
    ([Status.SKIP], Status.SKIP, 0),
    ([Status.PASS, Status.WARN, Status.SKIP], Status.WARN, 1),
    ([Status.WARN, Status.FAIL, Status.PASS], Status.FAIL, 2),
])
def test_worst_status_drives_the_exit_code(statuses, worst, code):
    report = Report.of(_row(s, f"c{i}") for i, s in enumerate(statuses))
    assert report.worst is worst
    assert report.exit_code == code
    assert report.passed is (code == 0)


def test_an_empty_report_fails_closed():
    assert Report.of([]).worst is Status.FAIL
    assert not Report.of([]).passed


def test_warn_and_fail_rows_must_carry_a_fix():
    with pytest.raises(ValueError, match="needs a fix"):
        CheckResult("x", Status.FAIL, "broken")


def test_json_schema():
    report = Report.of([_row(Status.PASS, "a"), CheckResult("b", Status.FAIL, "d", "f", {"max_diff": 0.5})])
    data = json.loads(report.to_json())
    assert set(data) == {"schema_version", "worst", "passed", "exit_code", "results"}
    assert data["worst"] == "FAIL" and data["exit_code"] == 2 and data["passed"] is False
    assert data["results"][1] == {"check": "b", "status": "FAIL", "detail": "d", "fix": "f", "data": {"max_diff": 0.5}}


def test_table_has_the_four_columns_and_wraps_long_details():
    long = "word " * 80
    table = Report.of([CheckResult("dispatch.x", Status.FAIL, long, "do this")]).to_table(width=120)
    header = table.splitlines()[0]
    assert [c.strip() for c in header.split("|")] == ["CHECK", "STATUS", "DETAIL", "FIX"]
    assert all(len(line) <= 120 for line in table.splitlines())
    assert table.count("word") == 80
    assert "RESULT: FAIL (exit 2)" in table


def test_json_is_strict_even_for_missing_measurements():
    row = CheckResult("isolation.conv", Status.FAIL, "no conv layer", "fix", {"packed_rel": float("nan"),
                                                                              "per_layer": [1.0, float("inf")]})
    data = json.loads(Report.of([row]).to_json())
    assert data["results"][0]["data"] == {"packed_rel": None, "per_layer": [1.0, None]}
