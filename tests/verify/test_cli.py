import json

import pytest


@pytest.mark.training  # a fresh interpreter running every check: ~10-20 s on 2 cores
def test_bare_verify_on_cpu_exits_2_with_a_readable_table(run_verify, rows_by_check, tmp_path):
    code, out, err = run_verify("--json-file", str(tmp_path / "verify.json"))
    assert code == 2, err
    rows_by_check((tmp_path / "verify.json").read_text())   # every check's rows in one table agree
    assert "Traceback" not in out + err
    lines = out.splitlines()
    assert [c.strip() for c in lines[0].split("|")] == ["CHECK", "STATUS", "DETAIL", "FIX"]
    assert "no build lock at /nonexistent/lock.json" in out
    assert "no CUDA device" in out
    assert "needs CUDA" in out                      # fused ops: never a PASS without a GPU
    assert "torch reference path" in out            # dispatch ran for real
    assert out.rstrip().endswith("RESULT: FAIL (exit 2)")


@pytest.mark.training
def test_isolation_json_reports_measured_differences_per_layer_kind(cpu_lock_path, run_verify, rows_by_check):
    code, out, err = run_verify("--device", "cpu", "--checks", "isolation", "--json", "--lock", str(cpu_lock_path))
    assert code == 2, err
    report = json.loads(out)
    assert report["worst"] == "FAIL" and report["exit_code"] == 2 and report["passed"] is False
    rows = rows_by_check(out)
    assert rows["lock"]["status"] == "PASS"
    for kind in ("attention", "gdn", "conv"):
        data = rows[f"isolation.{kind}"]["data"]
        assert {"packed_rel", "withheld_rel", "packed_abs", "tolerance"} <= set(data)
        assert data["withheld_rel"] > data["blind_threshold"]          # negative control behaves
    assert rows["isolation.gdn"]["status"] == rows["isolation.conv"]["status"] == "FAIL"
    assert rows["isolation.logits"]["status"] == "FAIL"


@pytest.mark.unit
def test_unknown_check_is_a_usage_failure_not_a_traceback(run_verify):
    code, out, err = run_verify("--checks", "dispatch,bogus")
    assert code == 2
    assert "unknown check(s): bogus" in out and "choose from: environment,model_fit,dispatch,fused_ops,isolation" in out
    assert "Traceback" not in err


@pytest.mark.unit
def test_damaged_lock_is_a_fail_row(tmp_path):
    from verify import run_checks

    bad = tmp_path / "lock.json"
    bad.write_text("{not json")
    report = run_checks("environment", device="cpu", lock=bad)
    rows = {r.check: r for r in report.results}
    assert rows["lock"].status.name == "FAIL" and "cannot read build lock" in rows["lock"].detail
    assert rows["lock"].fix


@pytest.mark.unit
def test_library_api_for_the_entrypoint(cpu_lock_path):
    from verify import Status, run_checks

    report = run_checks("dispatch", device="cpu", lock=cpu_lock_path)
    assert report.worst is Status.FAIL and report.passed is False and report.exit_code == 2
    assert json.loads(report.to_json())["results"][0]["check"] == "lock"


@pytest.mark.unit
@pytest.mark.parametrize("status, code", [("PASS", 0), ("SKIP", 0), ("WARN", 1), ("FAIL", 2)])
def test_cli_exit_code_follows_the_worst_status(monkeypatch, tmp_path, capsys, status, code):
    from verify import cli
    from verify.report import CheckResult, Report, Status

    row = CheckResult("x", Status[status], "d", "" if status in ("PASS", "SKIP") else "f")
    monkeypatch.setattr(cli, "run_checks", lambda *a, **k: Report.of([CheckResult("lock", Status.PASS, "ok"), row]))
    out_file = tmp_path / "report.json"
    assert cli.main(["--json-file", str(out_file)]) == code
    worst = "PASS" if status == "SKIP" else status   # not-applicable rows never outrank a pass
    assert f"RESULT: {worst} (exit {code})" in capsys.readouterr().out
    assert json.loads(out_file.read_text())["exit_code"] == code


def test_checks_that_need_transformers_fail_closed_with_the_reason_when_it_is_missing(monkeypatch, env_lock,
                                                                                      tmp_path):
    """A kernels-only image (no transformers) must get readable FAIL rows, never a crash."""
    import importlib.util

    from verify.report import Status
    from verify.runner import run_checks

    lock = tmp_path / "lock.json"
    lock.write_text(env_lock.to_json())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else
                        real(name, *a))
    report = run_checks("dispatch,isolation,fused_ops", device="cpu", lock=str(lock))
    rows = {r.check: r for r in report.results}
    for name in ("dispatch", "isolation", "fused_ops"):
        assert rows[name].status is Status.FAIL
        assert "transformers is not installed" in rows[name].detail and "crashed" not in rows[name].detail
        assert "python.requirements" in rows[name].fix
