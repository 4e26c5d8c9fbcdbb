"""A model of a type no family covers gets one line (stderr and the guard's record), and
FTIMAGE_REQUIRE_FAMILY=1 refuses it before the model exists; a covered model gets neither."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.guard.conftest import clean_env

pytestmark = pytest.mark.unit

# Llama is a transformers model no family file names; Qwen3.5 is covered.
UNCOVERED = """
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64))
LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64))
print("built")
"""
COVERED = """
from families import load_family
from families.runtime import build_model
build_model(load_family("qwen3_5_text"), "tiny", attn_implementation="sdpa")
print("built")
"""


def run(venv_python, code: str, tmp_path, **env):
    report = tmp_path / "guard.json"
    proc = subprocess.run([str(venv_python), "-c", code], capture_output=True, text=True, timeout=300,
                          env=clean_env(FTIMAGE_GUARD_REPORT=str(report), **env))
    return proc, report


def test_an_uncovered_model_type_is_one_line_on_stderr_and_in_the_record(venv_python, tmp_path):
    proc, report = run(venv_python, UNCOVERED, tmp_path)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "not covered: model_type llama" in line]
    assert len(lines) == 1, proc.stderr            # two models of one type: one line
    assert "this image proves: " in lines[0] and "qwen3_5_text" in lines[0]
    data = json.loads(report.read_text())
    assert data["status"] == "not covered"
    assert data["not_covered"] == [lines[0].split("ftimage-guard: ", 1)[1].split(": nothing checks")[0]]


def test_require_family_refuses_an_uncovered_model_before_it_exists(venv_python, tmp_path):
    proc, _ = run(venv_python, UNCOVERED, tmp_path, FTIMAGE_REQUIRE_FAMILY="1")
    assert proc.returncode == 3 and "built" not in proc.stdout
    assert "refused this run: not covered: model_type llama" in proc.stderr
    assert "FTIMAGE_REQUIRE_FAMILY" in proc.stderr


def test_a_covered_model_gets_no_line(venv_python, tmp_path):
    proc, _ = run(venv_python, COVERED, tmp_path, FTIMAGE_REQUIRE_FAMILY="1")
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr
    assert "not covered" not in proc.stderr
