"""Engine tier: images/smoke-trl (the CPU twin of images/qwen27b-trl) runs TRL's real SFTTrainer
behind the gate, and the runtime guard in its venv judges TRL's own process. On CPU no fused
kernel exists: TRL's default packed, padding-free configuration is refused by the guard (the bound
torch fallback drops the boundaries) even with the gate's override, and padded batches train
under the override with the fallback on record. The GPU kit proves the pass path with the kernels."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import REPO_ROOT
from tests.fixtures.containers import run_in

pytestmark = pytest.mark.engine

GATE = "/opt/ftimage/bin/ftimage-gate"
PYTHON = "/opt/ftimage/venv/bin/python"


@pytest.fixture(scope="module")
def trl_job(tmp_path_factory):
    """What a team mounts: its training script (tests/guard/scenarios.py, TRL's SFTTrainer on the
    tiny Qwen3.5) and a tokenizer, readable by the image's non-root user."""
    from tests.fixtures.chat import synthetic_conversations, write_tokenizer

    root = tmp_path_factory.mktemp("trl-job")
    for sub in ("guard", "fixtures"):
        shutil.copytree(REPO_ROOT / "tests" / sub, root / "tests" / sub,
                        ignore=shutil.ignore_patterns("__pycache__", "test_*.py"))
    rows = synthetic_conversations(64, seed=1)
    write_tokenizer(root / "tokenizer", [m["content"] for r in rows for m in r["messages"]])
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def _sft(trl_image, trl_job, batches: str, env: dict) -> tuple[int, str]:
    spec = {"trainer": "trl", "kernels": "none", "attention": "sdpa", "batches": batches, "steps": 2,
            "tokenizer": "/job/tokenizer"}
    command = [GATE, "--", PYTHON, "/job/tests/guard/scenarios.py", json.dumps(spec), "/tmp/work"]
    return run_in(trl_image, command, environment={"HOME": "/tmp", **env},
                  volumes={str(trl_job): {"bind": "/job", "mode": "ro"}})


def test_trl_is_locked_in_the_image(trl_image):
    code, out = run_in(trl_image, [PYTHON, "-I", "-c", "import trl, accelerate; print(trl.__version__, "
                                                     "accelerate.__version__)"])
    assert code == 0 and out.split()[-2:] == ["1.16.0", "1.15.0"], out


def test_trl_packed_on_the_torch_fallback_is_refused_by_the_guard_even_with_the_override(trl_image, trl_job):
    code, out = _sft(trl_image, trl_job, "packed", {"FTIMAGE_ALLOW_FALLBACK": "1"})
    assert code == 3, out[-4000:]
    assert "[gate]" in out and "override given" in out    # the gate let it through, on the record
    refusals = [line for line in out.splitlines() if line.startswith("error: ftimage-guard")]
    assert len(refusals) == 1, out[-4000:]
    assert "TRAINED" not in out and "Traceback" not in out, out[-4000:]


def test_trl_padded_trains_under_the_override_with_the_fallback_on_record(trl_image, trl_job):
    code, out = _sft(trl_image, trl_job, "padded", {"FTIMAGE_ALLOW_FALLBACK": "1", "FTIMAGE_JSON_LOGS": "1"})
    assert code == 0 and "TRAINED" in out, out[-4000:]
    events = [json.loads(line) for line in out.splitlines() if line.startswith('{"') and '"guard"' in line]
    assert events and events[-1]["report"]["status"] == "fallback allowed", out[-4000:]


def test_without_the_override_the_gate_refuses_trl_before_it_starts(trl_image, trl_job):
    code, out = _sft(trl_image, trl_job, "padded", {})
    assert code == 3 and "verify did not pass" in out and "TRAINED" not in out, out[-4000:]


def test_the_deploy_example_runs_trl_packing_and_the_guard_judges_it(trl_image, tmp_path_factory):
    """deploy/trl/sft_packed.py, exactly as shipped, on the tiny model: on CPU only the torch
    fallback exists, so its packed run must be stopped at step 1 with the fix."""
    from tests.fixtures.chat import write_fixture

    root = tmp_path_factory.mktemp("trl-example")
    fixture = write_fixture(root / "fx", n_rows=64)
    shutil.copytree(REPO_ROOT / "deploy" / "trl", root / "trl")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    command = [GATE, "--", PYTHON, "/job/trl/sft_packed.py", "--model", "/job/fx/model", "--data",
               f"/job/fx/{fixture.data.name}", "--output", "/tmp/sft", "--max-steps", "2", "--max-length", "128",
               "--cpu", "--attn", "sdpa"]
    code, out = run_in(trl_image, command, environment={"HOME": "/tmp", "FTIMAGE_ALLOW_FALLBACK": "1"},
                       volumes={str(root): {"bind": "/job", "mode": "ro"}})
    assert code == 3, out[-4000:]
    refusals = [line for line in out.splitlines() if line.startswith("error: ftimage-guard")]
    assert len(refusals) == 1 and "Traceback" not in out, out[-4000:]
    assert "flash_attention_2" in out, out[-4000:]
