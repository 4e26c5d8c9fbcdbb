"""The shipped deploy examples parse and agree with the entrypoint's config and launcher."""
from __future__ import annotations

from pathlib import Path

import pytest

from contracts.finetune_config import build_config, read_yaml

pytestmark = pytest.mark.unit
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_config_is_valid():
    cfg = build_config([read_yaml(DEPLOY / "finetune.example.yaml")])
    assert cfg.packing.mode == "packed" and cfg.parallel.param_dtype == "bfloat16"


def test_trainer_v2_nproc_auto_is_one_process_per_gpu(monkeypatch):
    """Kubeflow Trainer v2 sets PET_NPROC_PER_NODE=auto on a GPU node (its Torch plugin, v2.2.0):
    the launcher takes it as its own default, one process per visible GPU, not as a bad integer."""
    from contracts.finetune_config import FinetuneConfig
    from entrypoint.launcher import torchrun

    monkeypatch.setattr(torchrun, "device_count", lambda: 4)
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}
    topo = torchrun.resolve_topology(FinetuneConfig(), env)
    assert (topo.nnodes, topo.node_rank, topo.nproc_per_node, topo.rdzv) == (2, 1, 4, "static")
    assert (topo.master_addr, topo.master_port) == ("job-node-0-0.job", 29500)
    monkeypatch.setattr(torchrun, "device_count", lambda: 0)
    assert torchrun.resolve_topology(FinetuneConfig(), {"PET_NPROC_PER_NODE": "auto"}).nproc_per_node == 1
    with pytest.raises(torchrun.LaunchError, match="expected an integer"):
        torchrun.resolve_topology(FinetuneConfig(), {"PET_NPROC_PER_NODE": "eight"})
