"""Our finetune on a Mamba2 hybrid (Falcon-H1), two ranks on CPU, with the CPU doubles of the
kernels (they honour seq_idx as mamba-ssm and causal-conv1d do): the trainer's model path hands
seq_idx to every Mamba2 mixer's fused kernel in a training step, and the packed loss and logits of
a row equal the documents run one at a time; a real packed run trains. (How much a withheld
seq_idx leaks, per layer kind, is verify's packing probe: tests/verify/test_family_rows.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from entrypoint.launcher.torchrun import free_port
from tests.fixtures.chat import entrypoint_env, write_fixture

pytestmark = pytest.mark.training

REPO = Path(__file__).resolve().parents[2]
DOUBLES = REPO / "tests" / "guard" / "kernels" / "fused"
# Falcon-H1: a Mamba2 hybrid without MoE experts (their checkpoint names are converted at load; see
# tests/entrypoint/test_family_checkpoints.py)
FAMILY = "falcon_h1"


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("mamba2"), family=FAMILY, n_rows=96)


def test_packed_loss_equals_the_documents_alone_on_two_ranks(mamba2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "static",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "tests" / "entrypoint" / "hybrid_loss_probe.py"), str(mamba2.model_dir), str(DOUBLES)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=entrypoint_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    # two ranks print at once: the lines may interleave, so read each JSON object out of the stream
    decoder, results, text = json.JSONDecoder(), [], proc.stdout
    at = text.find("{")
    while at != -1:
        obj, end = decoder.raw_decode(text, at)
        results.append(obj)
        at = text.find("{", end)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["family"].endswith("FalconH1ForCausalLM")   # FSDP2 prefixes the class name
        assert abs(r["packed"] - r["alone"]) <= 1e-5 * r["alone"], r
        assert r["logits_rel"] <= 1e-4, r
        # in a training step each Mamba2 mixer called the fused split kernel, always with seq_idx
        calls = r["training_calls"]
        assert calls and {name for name, _ in calls} == {"mamba2_split_conv1d_scan_combined"}, calls
        assert all(given for _, given in calls), calls


def test_a_packed_mamba2_finetune_trains_on_two_ranks(mamba2, tmp_path):
    from tests.entrypoint.test_training import _finish, _launch_packed, _losses

    out = tmp_path / "out"
    log = _finish(_launch_packed(mamba2.config, out, "train.max_steps=6", "checkpoint.export=false",
                                 pythonpath=str(DOUBLES)), timeout=400)
    losses = _losses(out)
    assert len(losses) == 6 and losses[6] < losses[1], (losses, log[-2000:])
    report = json.loads((out / "run_report.json").read_text())
    assert report["packing"]["effective"] == "packed"
