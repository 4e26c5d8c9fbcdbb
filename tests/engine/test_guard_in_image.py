"""Engine tier: the runtime guard is in every Python process of the built image. A plain trainer
that is not ours (a 20-line loop on transformers' own Qwen3.5, packed rows with position resets,
sdpa, the torch fallback) is stopped at its first training forward with the fix; without packing
and with the override it trains, and the guard's report names the fallback; FTIMAGE_GUARD=off
runs it unchecked, logged. (The guard stands aside only in verify's own process, which runs the
fallback on purpose to measure it: test_verify_container.py's isolation rows prove that.)"""
from __future__ import annotations

import json

import pytest

from tests.fixtures.containers import run_in as _run

pytestmark = pytest.mark.engine

# A team's own loop, run with the image's python (the venv's site-packages hold the guard's .pth).
TRAINER = r"""
import sys, torch
from families import load_family
from families.runtime import build_model
model = build_model(load_family("qwen3_5_text"), "tiny", attn_implementation="sdpa")
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
packed = sys.argv[1] == "packed"
ids = torch.randint(0, 500, (1, 64))
pos = torch.cat([torch.arange(40), torch.arange(24)])[None] if packed else torch.arange(64)[None]
for step in range(3):
    loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"trained step {step + 1}", flush=True)
"""


def _python(*args: str) -> list[str]:
    return ["/opt/ftimage/venv/bin/python", "-I", *args]


def test_the_guard_is_installed_and_inert_until_the_modeling_module_is_imported(smoke_image):
    code, out = _run(smoke_image, _python("-c", "import sys; print(sorted(m for m in sys.modules if m.startswith("
                                           "('guard', 'torch', 'transformers'))))"))
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "['guard', 'guard.boot']", out


def test_a_foreign_trainer_feeding_packed_rows_to_the_torch_fallback_is_stopped_at_step_1(smoke_image):
    code, out = _run(smoke_image, _python("-c", TRAINER, "packed"))
    assert code == 3, out[-3000:]
    assert "trained step" not in out and "Traceback" not in out, out[-3000:]
    assert "guard" in out and "fix" in out, out[-3000:]
    assert "padding_free" in out or "DataCollatorWithFlattening" in out or "finetune" in out, out[-3000:]


def test_padded_batches_with_the_override_train_and_the_report_names_the_fallback(smoke_image):
    code, out = _run(smoke_image, _python("-c", TRAINER, "padded"),
                     environment={"FTIMAGE_ALLOW_FALLBACK": "1", "FTIMAGE_JSON_LOGS": "1"})
    assert code == 0, out[-3000:]
    assert "trained step 3" in out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{") and "guard" in line]
    assert records, out[-3000:]
    assert "torch" in json.dumps(records[-1]).lower(), records[-1]


def test_guard_off_runs_unchecked_and_says_so(smoke_image):
    code, out = _run(smoke_image, _python("-c", TRAINER, "packed"), environment={"FTIMAGE_GUARD": "off"})
    assert code == 0 and "trained step 3" in out, out[-3000:]
    assert "FTIMAGE_GUARD=off" in out

