"""`finetune export --checkpoint step-N`: any kept checkpoint as HF safetensors, on its own.

The launcher (prepare_export) checks the checkpoint and the source model before any rank starts,
then the ranks build the model on the meta device, shard it (DCP reshards the checkpoint to this
world size), read the checkpoint's model weights (as data only, like a resume), and write the
export exactly as a training run's is written (hf_checkpoint.export), to
<output.dir>/exports/step-N. No verify gate: exporting runs no fused kernel.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from contracts.finetune_config import FinetuneConfig, build_config
from contracts.folder_guard import UnsafeFolder, real_dir
from entrypoint.launcher.output_dir import resolve_output_dir
from entrypoint.launcher.preflight import FinetuneError, Launch, check_writable, config_layers, lock_layer
from entrypoint.launcher.run_plan import PackingDecision, RunPlan
from entrypoint.launcher.torchrun import LaunchError, cache_env, resolve_topology, torchrun_argv, worker_env
from entrypoint.observability.console import Console


def checkpoint_path(cfg: FinetuneConfig, name: str) -> Path:
    """A step-* name under output.dir/checkpoints, or a path to a step folder."""
    path = Path(name)
    if not path.is_absolute() and "/" not in name:
        path = Path(cfg.output.dir) / "checkpoints" / name
    return path


def prepare_export(*, config_file: str | None, overrides: list[str], checkpoint: str, env: dict,
                   log: Callable[[str], None]):
    # the checkpoint modules import numpy and torch: imported when an export is planned, not with this module
    # (finetune_cli imports it for every finetune command; a config error exits without them)
    from entrypoint.checkpoint.dcp import CheckpointError, read_state
    from entrypoint.checkpoint.hf_safetensors import SourceCheckpointError, check_source

    defaults, lock = lock_layer(log)
    cfg = build_config([layer for _, layer in config_layers(config_file, overrides, defaults)])
    try:
        cfg.output.dir = str(resolve_output_dir(cfg.output.dir))
        check_source(Path(cfg.model.path))
        path = checkpoint_path(cfg, checkpoint)
        state = read_state(path)
        topo = resolve_topology(cfg, env)
        caches = cache_env(cfg, env)
        check_writable(cfg.output.dir)
        launch_dir = real_dir(Path(cfg.output.dir) / ".launch")
    except (UnsafeFolder, SourceCheckpointError, CheckpointError, LaunchError) as exc:
        raise FinetuneError.from_error(exc) from None
    log(f"[finetune] exporting {path} (step {state.step}, saved by {state.world_size} ranks) on "
        f"{topo.nnodes * topo.nproc_per_node} ranks; no verify gate: exporting runs no fused kernel")
    plan = RunPlan(config=cfg, config_file=config_file, overrides=list(overrides), verify={}, allow_fallback=False,
                   allow_fallback_flag=False, packing=PackingDecision(requested="-", effective="-", reason="export"),
                   lock=lock, topology=topo.__dict__, action="export", export_checkpoint=str(path),
                   launched_at=time.time())
    plan_path = plan.write(launch_dir / f"export-node{topo.node_rank}.json")
    return Launch(argv=torchrun_argv(topo, plan_path), env=worker_env(cfg, topo, {**env, **caches}),
                  plan_path=plan_path, plan=plan)


def run_export(plan, rank: int, world: int, device) -> dict:
    """Every rank: the checkpoint's weights into a sharded model, then the sharded HF export."""
    # the ranks' side (torch, the checkpoint, the model): imported here, not with this module (see prepare_export)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from entrypoint.checkpoint.dcp import Checkpointer, read_state, step_of
    from entrypoint.checkpoint.hf_safetensors import export
    from entrypoint.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
    from entrypoint.distributed.parallelize import DTYPES, apply_fsdp, build_mesh
    from entrypoint.model import build_on_meta, load_tokenizer, model_family, rebuild_buffers, resolve_attention

    cfg = plan.config
    con = Console(rank)
    path = Path(plan.export_checkpoint)
    read_state(path, ranks=[rank])   # this rank's RNG file; the launcher checked them all
    attn = resolve_attention(cfg.model.attn_implementation, (plan.lock or {}).get("attn_implementation"),
                             device.type)
    model = build_on_meta(cfg.model.path, attn_implementation=attn, trust_remote_code=cfg.model.trust_remote_code)
    p = cfg.parallel
    apply_fsdp(model, build_mesh(device.type, world, p.dp_replicate), param_dtype=p.param_dtype,
               reduce_dtype=p.reduce_dtype, family_name=model_family(model).name)   # its units, as in training
    model.to_empty(device=device)
    state = {"model": get_model_state_dict(model)}
    reader = SafeFileSystemReader(str(path))
    reader.read_metadata()
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    rebuild_buffers(model, device)
    out = Path(cfg.output.dir) / "exports" / path.name
    started = time.perf_counter()
    if rank == 0:
        real_dir(out.parent)
    barrier = Checkpointer(path.parent, keep=1, rank=rank, world_size=world, device=device).barrier
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
    export(model, model.config, tokenizer, Path(cfg.model.path), out, dtype=DTYPES[cfg.checkpoint.export_dtype],
           rank=rank, barrier=barrier)
    con.info(f"exported {path.name} to {out} in {time.perf_counter() - started:.1f}s")
    return {"exported": str(out), "step": step_of(path), "interrupted": False}
