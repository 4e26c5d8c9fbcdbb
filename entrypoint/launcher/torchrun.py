"""From a validated config to a torchrun command line: the topology (one node or many), the
caches' environment, the workers' environment, and the argv of `python -m torch.distributed.run
-m entrypoint.train`. preflight.py gates on verify and writes the run plan; supervise.py starts
the agent that runs this command line.

Topology:
* one node: `--rdzv-backend static --master-addr 127.0.0.1 --master-port <free>`. The
  default rendezvous resolves the container's hostname, which hangs under `docker run
  --network none`; static on loopback needs no name service. On CPU, GLOO_SOCKET_IFNAME=lo
  keeps gloo off interfaces that do not exist there.
* several nodes, from the standard environment: NNODES / NODE_RANK / MASTER_ADDR /
  MASTER_PORT (also the PET_* names torchrun reads, which the Kubeflow Training Operator and
  Trainer v2 set, and Slurm's SLURM_NNODES / SLURM_NODEID), static rendezvous; or c10d when
  RDZV_ENDPOINT (or PET_RDZV_ENDPOINT) is set, which tolerates nodes arriving in any order.
  NPROC_PER_NODE=auto (Trainer v2's PET_NPROC_PER_NODE on a GPU node) is the default: one
  process per visible GPU.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import FixableError
from contracts.finetune_config import FinetuneConfig
from entrypoint.launcher.job_env import job_env
from verify.scratch import NoScratch


class LaunchError(FixableError):
    fix_in_str = True

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def _env(env: dict, *names: str) -> str | None:
    for n in names:
        if env.get(n):
            return env[n]
    return None


@dataclass(frozen=True, kw_only=True)
class Topology:
    nnodes: int
    node_rank: int
    nproc_per_node: int
    rdzv: str                 # static | c10d
    master_addr: str
    master_port: int
    rdzv_endpoint: str = ""
    rdzv_id: str = ""

    def torchrun_args(self) -> list[str]:
        args = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node)]
        if self.rdzv == "c10d":
            return args + ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
        return args + ["--rdzv-backend", "static", "--node-rank", str(self.node_rank),
                       "--master-addr", self.master_addr, "--master-port", str(self.master_port)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_count() -> int:
    import torch  # only to count GPUs: preflight imports this module before the config is checked

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_topology(cfg: FinetuneConfig, env: dict) -> Topology:
    gpus = device_count()
    nproc_env = _env(env, "NPROC_PER_NODE", "PET_NPROC_PER_NODE")
    nproc = cfg.launch.nproc_per_node or (0 if nproc_env == "auto" else _int(nproc_env, 0)) or gpus or 1
    if gpus and nproc > gpus:
        raise LaunchError(f"launch.nproc_per_node={nproc} but only {gpus} GPUs are visible",
                          "lower launch.nproc_per_node or expose more GPUs (--gpus all)")
    nnodes = cfg.launch.nnodes or _int(_env(env, "NNODES", "PET_NNODES", "SLURM_NNODES"), 1)
    endpoint = _env(env, "RDZV_ENDPOINT", "PET_RDZV_ENDPOINT") or ""
    rdzv = cfg.launch.rdzv
    if rdzv == "auto":
        rdzv = "c10d" if (nnodes > 1 and endpoint) else "static"
    if nnodes == 1 and rdzv == "static":
        return Topology(nnodes=1, node_rank=0, nproc_per_node=nproc, rdzv="static", master_addr="127.0.0.1",
                        master_port=cfg.launch.master_port or free_port())
    if rdzv == "c10d":
        if not endpoint:
            raise LaunchError("launch.rdzv=c10d needs a rendezvous endpoint",
                              "set RDZV_ENDPOINT=host:port (the same on every node)")
        job = _env(env, "RDZV_ID", "PET_RDZV_ID", "SLURM_JOB_ID") or "ftimage"
        return Topology(nnodes=nnodes, node_rank=0, nproc_per_node=nproc, rdzv="c10d", master_addr="",
                        master_port=0, rdzv_endpoint=endpoint, rdzv_id=job)
    addr = _env(env, "MASTER_ADDR", "PET_MASTER_ADDR")
    rank = _env(env, "NODE_RANK", "PET_NODE_RANK", "SLURM_NODEID", "GROUP_RANK")
    missing = [n for n, v in (("MASTER_ADDR", addr), ("NODE_RANK", rank)) if v is None]
    if missing:
        raise LaunchError(f"multi-node run ({nnodes} nodes) but {', '.join(missing)} not set",
                          "set NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT on every node "
                          "(deploy/ has PyTorchJob and Slurm examples), or RDZV_ENDPOINT for c10d")
    port = cfg.launch.master_port or _int(_env(env, "MASTER_PORT", "PET_MASTER_PORT"), 29500)
    return Topology(nnodes=nnodes, node_rank=int(rank), nproc_per_node=nproc, rdzv="static",
                    master_addr=addr, master_port=port)


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        raise LaunchError(f"expected an integer, got {text!r}", "fix the launch environment variable") from None


def cache_env(cfg: FinetuneConfig, env: dict) -> dict:
    """The job's caches, HOME, TMPDIR and user name (job_env.py), for the launcher's workers; a
    uid that can write nowhere is a LaunchError naming every folder tried."""
    try:
        return job_env(env)
    except NoScratch as exc:
        raise LaunchError(str(exc), exc.fix) from None


def worker_env(cfg: FinetuneConfig, topo: Topology, env: dict) -> dict:
    """Environment for torchrun and the workers (`env` already holds the caches, cache_env)."""
    env = dict(env)
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if Path(cfg.model.path).exists():
        env.setdefault("HF_HUB_OFFLINE", "1")  # a mounted model needs no hub; never wait on DNS
    if device_count() == 0 and topo.nnodes == 1:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, topo.nproc_per_node))))
    env["PYTHONUNBUFFERED"] = "1"
    # the launcher died: torchrun passes SIGTERM to the workers, and gives their checkpoint as long
    # as a stop may take before it kills them (its own default: 30 s)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(cfg.launch.stop_grace_seconds))
    if sys.flags.isolated:
        # torchrun starts the workers as `python -u -m entrypoint.train`, without -I: keep them
        # as isolated as this process (no working-directory or user-site modules, no PYTHONPATH)
        env["PYTHONSAFEPATH"] = "1"
        env["PYTHONNOUSERSITE"] = "1"
        env.pop("PYTHONPATH", None)
    return env


def torchrun_argv(topo: Topology, plan_path: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *topo.torchrun_args(),
            "-m", "entrypoint.train", "--plan", str(plan_path)]
