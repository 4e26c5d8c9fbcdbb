"""finetune, as a library: config layers -> verify gate -> packing decision -> run plan.

The CLI calls `prepare` and execs the returned argv. Tests call it too.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from contracts.finetune_config import FinetuneConfig, build_config, parse_override, read_yaml, set_dotted
from entrypoint.gate import GateOutcome, run_verify
from entrypoint.launch import LaunchError, cache_env, resolve_topology, torchrun_argv, worker_env, write_plan

EXIT_GATE = 3  # verify did not pass and --allow-fallback was not given


class FinetuneError(Exception):
    def __init__(self, message: str, fix: str, exit_code: int = 2):
        super().__init__(message)
        self.fix = fix
        self.exit_code = exit_code


@dataclass(frozen=True, kw_only=True)
class Launch:
    argv: list[str]
    env: dict
    plan_path: Path
    plan: dict


def lock_layer(log: Callable[[str], None]) -> tuple[dict, dict | None]:
    """The image's finetune_defaults (lowest config layer) and a lock summary for the report.
    Outside an image there is no lock: defaults only, and we say so."""
    from contracts.lock import LockError, load_lock, lock_path
    from entrypoint.info import lock_summary_dict

    try:
        lock = load_lock()
    except LockError as exc:
        log(f"[finetune] note: {exc}; using built-in defaults only ({exc.fix})")
        return {}, None
    layer: dict = {}
    for key, value in (lock.finetune_defaults or {}).items():
        if isinstance(value, dict):
            layer[key] = dict(value)
        else:
            set_dotted(layer, key, value)  # dotted keys ("packing.budget") are accepted too
    summary = lock_summary_dict(lock)
    summary["path"] = str(lock_path())
    return layer, summary


def resolve_config(config_file: str | None, overrides: list[str], defaults: dict) -> FinetuneConfig:
    user = read_yaml(config_file) if config_file else {}
    cli: dict = {}
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(cli, key, value)
    return build_config([defaults, user, cli])


@contextlib.contextmanager
def _process_env(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def decide_packing(requested: str, gate: GateOutcome, allow_fallback: bool) -> dict:
    if gate.passed or requested == "padded":
        return {"requested": requested, "effective": requested,
                "reason": "verify passed" if gate.passed else "padded requested"}
    # Fallback kernels ignore cu_seqlens / seq_idx (DESIGN part 1): packed rows would let
    # every document attend to and convolve with the previous one. 2D padded is exact.
    return {"requested": requested, "effective": "padded",
            "reason": "verify did not pass (--allow-fallback): packed rows would leak context across documents "
                      "on fallback kernels, so batches are 2D padded"}


def prepare(*, config_file: str | None, overrides: list[str], allow_fallback: bool, env: dict,
            log: Callable[[str], None] = print, gate: Callable[[], GateOutcome] = run_verify) -> Launch:
    defaults, lock = lock_layer(log)
    cfg = resolve_config(config_file, overrides, defaults)
    cfg.output.dir = str(Path(cfg.output.dir).absolute())
    if not Path(cfg.data.path).exists():
        raise FinetuneError(f"data file {cfg.data.path} does not exist",
                            "mount the data and set data.path (JSONL or Parquet chat rows)")
    model = Path(cfg.model.path)
    if model.exists() and not (model / "config.json").is_file():
        raise FinetuneError(f"model.path {model} has no config.json",
                            "point model.path at a HF-format model directory (config.json, *.safetensors)")
    if not model.exists() and (model.is_absolute() or cfg.model.path.startswith(".")):
        raise FinetuneError(f"model.path {model} does not exist",
                            "mount the model directory into the container and set model.path to it")
    try:
        Path(cfg.output.dir).mkdir(parents=True, exist_ok=True)
        probe = Path(cfg.output.dir) / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FinetuneError(f"output.dir {cfg.output.dir} is not writable: {exc}",
                            "mount a writable volume and set output.dir (or --output-dir) to it") from None

    log("[finetune] running verify (the run stops unless it passes)")
    with _process_env(cache_env(cfg, env)):  # verify imports transformers/triton: keep caches writable
        outcome = gate()
    if not outcome.passed:
        log(outcome.table)
        if not allow_fallback:
            raise FinetuneError(
                f"verify did not pass (worst: {outcome.worst}); refusing to train on unverified kernels",
                "fix the failing checks above, or pass --allow-fallback (FTIMAGE_ALLOW_FALLBACK=1) to train "
                "anyway on the fallback path with 2D padded batches (recorded in run_report.json)", exit_code=EXIT_GATE)
        log(f"[finetune] WARNING: verify did not pass (worst: {outcome.worst}); --allow-fallback given, "
            "continuing ON THE RECORD with 2D padded batches")
    packing = decide_packing(cfg.packing.mode, outcome, allow_fallback)
    cfg.packing.mode = packing["effective"]
    try:
        topo = resolve_topology(cfg, env)
    except LaunchError as exc:
        raise FinetuneError(str(exc).split("\n")[0], exc.fix) from None
    plan = {"config": cfg.to_dict(), "config_file": config_file, "overrides": overrides,
            "verify": outcome.to_dict(), "allow_fallback": bool(allow_fallback and not outcome.passed),
            "allow_fallback_flag": bool(allow_fallback), "packing": packing, "lock": lock,
            "topology": topo.__dict__}
    plan_path = write_plan(plan, Path(cfg.output.dir), topo.node_rank)
    wenv = worker_env(cfg, topo, env)
    return Launch(argv=torchrun_argv(topo, plan_path), env=wenv, plan_path=plan_path, plan=plan)
