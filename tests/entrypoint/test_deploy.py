"""The shipped deploy examples parse and agree with the entrypoint's config and launcher."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from contracts.finetune_config import build_config, read_yaml
from entrypoint.launch import resolve_topology

pytestmark = pytest.mark.unit
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_config_is_valid():
    cfg = build_config([read_yaml(DEPLOY / "finetune.example.yaml")])
    assert cfg.packing.mode == "packed" and cfg.parallel.param_dtype == "bfloat16"


def test_pytorchjob_runs_finetune_in_the_operator_container():
    job = yaml.safe_load((DEPLOY / "kubernetes" / "pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    nodes = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"
    script = container["args"][0]
    assert f"NNODES={nodes}" in script and "python -m entrypoint finetune" in script
    # what the launcher makes of the pod environment the operator gives worker 2
    from contracts.finetune_config import FinetuneConfig

    cfg = FinetuneConfig()
    cfg.launch.nproc_per_node = 8
    topo = resolve_topology(cfg, {"NNODES": str(nodes), "NODE_RANK": "2", "MASTER_ADDR": "ftimage-sft-master-0",
                                  "MASTER_PORT": "23456"})
    assert (topo.nnodes, topo.node_rank, topo.master_addr) == (nodes, 2, "ftimage-sft-master-0")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_script_is_valid_bash():
    script = DEPLOY / "slurm" / "finetune.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "NODE_RANK=$SLURM_NODEID" in text
