"""What a user sees around a run: the LR schedule, --print-config, inspect-data, the gate
for any command, and bad data rows, each reported with a fix."""
from __future__ import annotations

import json
import math

import pytest
import torch

from entrypoint.launcher.verify_gate import GateOutcome
from tests.fixtures.chat import entrypoint_env, run_entrypoint


def test_lr_schedule_is_warmup_then_cosine_to_the_floor():
    from contracts.finetune_config import build_config
    from entrypoint.schedule import schedule

    cfg = build_config([{"train": {"lr": 1e-3, "warmup_steps": 4, "max_steps": 20, "min_lr_ratio": 0.1}}],
                       require_paths=False)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    sched = schedule(opt, cfg)
    got = []
    for _ in range(cfg.train.max_steps):
        got.append(sched.get_last_lr()[0])   # the lr the next optimizer step uses
        opt.step()
        sched.step()
    got.append(sched.get_last_lr()[0])
    peak, floor = 1e-3, 0.1
    for step, lr in enumerate(got):
        if step < 4:
            want = peak * step / 4             # linear warmup from 0
        else:
            progress = (step - 4) / (20 - 4)
            want = peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert lr == pytest.approx(want, rel=1e-9, abs=1e-15), (step, lr, want)
    assert got[4] == pytest.approx(peak) and got[-1] == pytest.approx(peak * floor)


def test_print_config_names_the_layer_that_set_each_key(fixture_dir):
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--print-config", "--packing", "padded",
                        "train.lr=0.25"])
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    assert rows["train.lr"].split()[1:] == ["0.25", "override"]
    assert rows["packing.mode"].split()[1:] == ['"padded"', "flag"]
    assert rows["data.path"].endswith(f"file {fixture_dir.config}")
    assert rows["train.beta1"].endswith("built-in default")
    assert rows["mesh:"].startswith("mesh: ") and "flat FSDP" in rows["mesh:"] and "per-GPU state" in rows["mesh:"]
    assert "Traceback" not in r.stderr


@pytest.fixture
def one_conversation(tmp_path):
    # the user's text is a substring of the chat template's own markup ("a" is in
    # "<|im_start|>assistant", "start" too): only the reply may be trained
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "start"}]}) + "\n")
    return data


def test_inspect_data_json_shows_only_the_reply_trained(fixture_dir, one_conversation):
    r = run_entrypoint(["inspect-data", "--config", str(fixture_dir.config), "--json",
                        f"data.path={one_conversation}"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (doc,) = out["documents"]
    assert doc["trained_spans"] == ["start<|im_end|>"]
    assert out["summary"]["documents"] == 1 and out["summary"]["bad_rows"] == {}
    assert out["summary"]["loss_tokens"] == doc["loss_tokens"] == 5  # the tokens of "start<|im_end|>"


def test_inspect_data_text_marks_trained_tokens(fixture_dir, one_conversation):
    r = run_entrypoint(["inspect-data", "--config", str(fixture_dir.config), "--rows", "1",
                        f"data.path={one_conversation}"])
    assert r.returncode == 0, r.stderr
    assert "user\na<|im_end|>" in r.stdout and "[[start<|im_end|>]]" in r.stdout
    assert "1 rows read, 1 documents, bad rows: none" in r.stdout


def test_inspect_data_bad_config_is_one_error(tmp_path):
    r = run_entrypoint(["inspect-data", "--config", str(tmp_path / "missing.yaml")])
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


def _gate_outcome(passed: bool) -> GateOutcome:
    return GateOutcome(passed=passed, worst="PASS" if passed else "FAIL", table="(verify table)")


def test_gate_execs_the_command_only_after_verify_passes(monkeypatch, gate_environ):
    from entrypoint import cli

    ran, seen = [], {}

    def fake_verify(**kw):
        seen.update(kw)
        return _gate_outcome(True)

    monkeypatch.setattr(cli, "exec_command", lambda argv: ran.append(argv) or 0)
    assert cli.gate(["--model", "/m", "--", "torchrun", "train.py"], run_verify=fake_verify) == 0
    assert ran == [["torchrun", "train.py"]] and seen == {"model": "/m", "param_dtype": "bfloat16"}


def test_gate_refuses_a_failed_verify_unless_overridden_on_the_record(monkeypatch, capsys, gate_environ):
    from entrypoint import cli

    ran = []
    monkeypatch.setattr(cli, "exec_command", lambda argv: ran.append(argv) or 0)
    monkeypatch.delenv("FTIMAGE_ALLOW_FALLBACK", raising=False)
    assert cli.gate(["--", "python", "train.py"], run_verify=lambda **kw: _gate_outcome(False)) == cli.EXIT_GATE
    assert ran == []
    err = capsys.readouterr().err
    assert "verify did not pass (worst: FAIL); not starting python" in err and "fix:" in err

    monkeypatch.setenv("FTIMAGE_ALLOW_FALLBACK", "1")
    assert cli.gate(["--", "python", "train.py"], run_verify=lambda **kw: _gate_outcome(False)) == 0
    assert ran == [["python", "train.py"]]
    assert "override given (FTIMAGE_ALLOW_FALLBACK=1)" in capsys.readouterr().err


def test_gate_without_a_command_is_a_usage_error(capsys, gate_environ):
    from entrypoint import cli

    assert cli.gate(["--"], run_verify=lambda **kw: _gate_outcome(True)) == cli.EXIT_USAGE
    assert "gate needs a command" in capsys.readouterr().err


def test_require_verify_gates_a_plain_command_for_real():
    # no stand-in: verify really runs (and fails closed on a host without the fused kernels)
    r = run_entrypoint(["echo", "should-not-run"], env=entrypoint_env(FTIMAGE_REQUIRE_VERIFY="1"), timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "should-not-run" not in r.stdout and "RESULT: FAIL" in r.stderr and "Traceback" not in r.stderr


def test_require_verify_gates_shell_too(monkeypatch):
    from entrypoint import cli

    calls = []
    monkeypatch.setenv("FTIMAGE_REQUIRE_VERIFY", "1")
    monkeypatch.setattr(cli, "gate", lambda argv, **kw: calls.append(argv) or 3)
    monkeypatch.setattr(cli, "exec_command", lambda argv: pytest.fail(f"ran ungated: {argv}"))
    assert cli.main(["shell", "-c", "echo should-not-run"]) == 3
    assert calls and calls[0][0] == "--" and calls[0][-2:] == ["-c", "echo should-not-run"]


def _rows(tmp_path, raw: bytes):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(raw)
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


@pytest.mark.parametrize("bad, reason", [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}',
     "undecodable_text"),
    (b"\xff\xfe not utf-8 at all", "not_utf8"),
    (b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}', "row_too_large"),
])
def test_hostile_rows_are_counted_not_fatal(tokenizer, tmp_path, bad, reason):
    from contracts.finetune_config import DataConfig
    from entrypoint.data.corpus_build import load_corpus

    path = _rows(tmp_path, (GOOD + "\n").encode() + bad + b"\n" + (GOOD + "\n").encode())
    corpus = load_corpus(DataConfig(path=str(path), max_length=256, max_row_bytes=4096), tokenizer)
    assert len(corpus) == 2 and corpus.bad.counts == {reason: 1}, corpus.bad.counts


@pytest.mark.parametrize("raw", [b"", b"\x00\x01\x02\x03binary" * 10, b"\n\n\n"], ids=["empty", "binary", "blank"])
def test_file_with_no_usable_rows_is_one_clear_error(tokenizer, tmp_path, raw):
    from contracts.finetune_config import DataConfig
    from entrypoint.data.corpus_build import load_corpus
    from entrypoint.data.sources import DataError

    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(path=str(_rows(tmp_path, raw)), max_length=256), tokenizer)
    assert "no usable rows" in str(info.value) and info.value.fix


@pytest.mark.parametrize("override, field", [
    ("train.min_lr_ratio=-0.1", "train.min_lr_ratio"), ("train.lr=nan", "train.lr"), ("train.lr=-1e-5", "train.lr"),
    ("train.lr=inf", "train.lr"), ("train.beta1=1.0", "train.beta1"), ("train.beta2=-0.1", "train.beta2"),
    ("launch.master_port=-1", "launch.master_port"), ("launch.master_port=70000", "launch.master_port"),
    ("launch.nproc_per_node=-1", "launch.nproc_per_node"), ("checkpoint.every=-1", "checkpoint.every"),
    ("train.warmup_steps=-1", "train.warmup_steps"), ("train.loss_chunk_tokens=-1", "train.loss_chunk_tokens"),
])
def test_config_numbers_are_range_checked_with_a_fix(fixture_dir, override, field):
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--print-config", override])
    assert r.returncode == 2, r.stdout + r.stderr
    assert field in r.stderr and "fix" in r.stderr and "Traceback" not in r.stderr
