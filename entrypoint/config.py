"""Typed finetune config: image defaults (from the lock) < user YAML < CLI overrides.

Every field is documented where it is declared. Loading collects ALL problems (unknown
keys, wrong types, bad values) and raises one ConfigError that lists each with a fix.
"""
from __future__ import annotations

import difflib
import os
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """One or more config problems, each `(where, problem, fix)`."""

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        lines = [f"  {where}: {problem}\n    fix: {fix}" for where, problem, fix in problems]
        super().__init__("invalid finetune config:\n" + "\n".join(lines))


@dataclass(kw_only=True)
class ModelConfig:
    path: str = ""                        # local HF-format dir (mounted), or a hub id if the cluster has network
    tokenizer: str = ""                   # tokenizer dir/id; empty = same as path
    attn_implementation: str = "auto"     # auto = the lock's promise (flash_attention_2 on GPU images), else sdpa
    trust_remote_code: bool = False       # never needed for Qwen3.5 (native in transformers 5.x)


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""                        # chat data: .jsonl/.json (one row per line) or .parquet
    format: str = "auto"                  # auto | jsonl | parquet
    messages_field: str = "messages"      # column holding the list of {role, content}
    max_length: int = 8192                # longest document in tokens; must be <= packing.budget
    overlong: str = "truncate"            # truncate | skip: policy for rows longer than max_length
    end_of_turn: str = "auto"             # token that ends an assistant turn (in the loss); auto = <|im_end|> or eos
    max_rows: int = 0                     # read at most this many rows (0 = all); for quick trials


@dataclass(kw_only=True)
class PackingConfig:
    mode: str = "packed"                  # packed (1D, varlen) | padded (2D baseline). Fallback forces padded.
    budget: int = 8192                    # tokens per micro-batch (the packed row length / padded area cap)
    shuffle_window: int = 10000           # documents shuffled together and best-fit-decreasing packed per window


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = 1000                 # optimizer steps
    grad_accum: int = 1                   # micro-batches per rank per step
    lr: float = 2e-5                      # peak learning rate
    min_lr_ratio: float = 0.1             # cosine floor as a fraction of lr
    warmup_steps: int = 50                # linear warmup from 0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0                # max global grad norm; 0 disables
    seed: int = 0                         # data order, init and RNG
    loss_chunk_tokens: int = 4096         # CE computed this many tokens at a time (recomputed in backward); 0 = all


@dataclass(kw_only=True)
class ParallelConfig:
    param_dtype: str = "bfloat16"         # compute dtype of the all-gathered params (MixedPrecisionPolicy)
    reduce_dtype: str = "float32"         # gradient reduce-scatter dtype
    activation_checkpoint: str = "none"   # none | full (every layer) | selective (every `ac_every`-th layer)
    ac_every: int = 2                     # selective: checkpoint one layer in this many
    reshard_after_forward: bool = True    # ZeRO-3 style; False keeps params gathered between fwd and bwd


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 500                      # save a DCP checkpoint every N steps (0 = only at the end)
    keep: int = 3                         # keep the newest k checkpoints
    resume: str = "auto"                  # auto (newest valid under output.dir) | never | PATH to a step dir
    export: bool = True                   # write HF safetensors (from_pretrained-loadable) at the end
    export_dtype: str = "bfloat16"        # dtype of the exported weights


@dataclass(kw_only=True)
class OutputConfig:
    dir: str = "./finetune-out"           # checkpoints, metrics.jsonl, run_report.json, caches
    log_every: int = 10                   # steps per metrics line
    profile_steps: str = ""               # "a:b" = torch.profiler trace over steps [a, b)
    peak_tflops: float = 0.0              # per-device peak for MFU; 0 = look up the GPU in peak_flops.json


@dataclass(kw_only=True)
class LaunchConfig:
    nproc_per_node: int = 0               # 0 = one per visible GPU, or 1 on CPU
    nnodes: int = 0                       # 0 = from $NNODES / $WORLD_SIZE-style env, else 1
    rdzv: str = "auto"                    # auto (static on 1 node / from env) | static | c10d
    master_port: int = 0                  # single node: 0 = pick a free port


@dataclass(kw_only=True)
class FinetuneConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_CHOICES = {
    "data.format": ("auto", "jsonl", "parquet"),
    "data.overlong": ("truncate", "skip"),
    "packing.mode": ("packed", "padded"),
    "parallel.param_dtype": ("bfloat16", "float32", "float16"),
    "parallel.reduce_dtype": ("float32", "bfloat16"),
    "parallel.activation_checkpoint": ("none", "full", "selective"),
    "checkpoint.export_dtype": ("bfloat16", "float32", "float16"),
    "launch.rdzv": ("auto", "static", "c10d"),
}


def parse_override(text: str) -> tuple[str, str]:
    """`train.lr=1e-4` -> ("train.lr", "1e-4"). The value stays text and is converted by the
    field's declared type: YAML-parsing it would turn `5:8` into the sexagesimal int 308."""
    if "=" not in text:
        raise ConfigError([(text, "override is not KEY=VALUE", "write e.g. train.max_steps=100")])
    key, raw = text.split("=", 1)
    return key.strip(), raw


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError([(dotted, f"{p} is not a section", "use section.key=value")])
    node[leaf] = value


def merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | os.PathLike) -> dict:
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError([(str(p), "config file not found", "pass --config PATH to an existing YAML file")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([(str(p), f"not valid YAML: {exc}", "fix the YAML syntax")]) from None
    if not isinstance(data, dict):
        raise ConfigError([(str(p), "top level is not a mapping", "write sections like `model:`, `data:`")])
    return data


def build_config(layers: list[dict]) -> FinetuneConfig:
    """Merge raw dict layers (lowest priority first) into a validated FinetuneConfig."""
    raw: dict = {}
    for layer in layers:
        raw = merge(raw, layer)
    problems: list[tuple[str, str, str]] = []
    cfg = _coerce(FinetuneConfig, raw, "", problems)
    bad_keys = {where for where, _, _ in problems}
    # validate values too, so one run reports everything; skip fields already reported
    problems.extend(p for p in _validate(cfg) if p[0] not in bad_keys)
    if problems:
        raise ConfigError(problems)
    return cfg


def _coerce(kind: type, raw: Any, where: str, problems: list) -> Any:
    if not isinstance(raw, dict):
        problems.append((where or "config", f"expected a mapping, got {type(raw).__name__}", "write key: value pairs"))
        return kind()
    hints = typing.get_type_hints(kind)
    names = {f.name: f for f in fields(kind)}
    values = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), list(names), n=1)
            fix = f"did you mean `{(where + '.') if where else ''}{close[0]}`?" if close else \
                f"known keys here: {', '.join(names)}"
            problems.append((path, "unknown key", fix))
            continue
        hint = hints[key]
        if is_dataclass(hint):
            values[key] = _coerce(hint, value, path, problems)
            continue
        coerced = _scalar(hint, value)
        if coerced is _BAD:
            problems.append((path, f"expected {hint.__name__}, got {value!r}", f"set {path} to a {hint.__name__}"))
            continue
        values[key] = coerced
    return kind(**values)


_BAD = object()


def _scalar(hint: type, value: Any) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        return _BAD
    if hint is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                return _BAD
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            return _BAD
    if hint is str:
        return str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else _BAD
    return value


def _validate(cfg: FinetuneConfig) -> list[tuple[str, str, str]]:
    problems = []
    for dotted, choices in _CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            problems.append((dotted, f"{value!r} is not one of {', '.join(choices)}", f"set {dotted} to one of them"))
    if not cfg.model.path:
        problems.append(("model.path", "not set", "set model.path to a mounted HF model directory"))
    if not cfg.data.path:
        problems.append(("data.path", "not set", "set data.path to a .jsonl or .parquet chat file"))
    if cfg.data.max_length > cfg.packing.budget:
        problems.append(("data.max_length", f"{cfg.data.max_length} exceeds packing.budget {cfg.packing.budget}",
                         "lower data.max_length or raise packing.budget; a document must fit one micro-batch"))
    positive = {"packing.budget": cfg.packing.budget, "data.max_length": cfg.data.max_length,
                "train.max_steps": cfg.train.max_steps, "train.grad_accum": cfg.train.grad_accum,
                "packing.shuffle_window": cfg.packing.shuffle_window, "output.log_every": cfg.output.log_every,
                "checkpoint.keep": cfg.checkpoint.keep, "parallel.ac_every": cfg.parallel.ac_every}
    for name, value in positive.items():
        if value < 1:
            problems.append((name, f"must be >= 1, got {value}", f"set {name} to a positive integer"))
    if cfg.train.lr <= 0:
        problems.append(("train.lr", "must be > 0", "set a positive learning rate"))
    if cfg.output.profile_steps:
        try:
            parse_profile_steps(cfg.output.profile_steps)
        except ValueError as exc:
            problems.append(("output.profile_steps", str(exc), "write START:STOP with 0 < START < STOP, e.g. 5:8"))
    return problems


def parse_profile_steps(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{text!r} is not START:STOP") from None
    if not 0 < a < b:
        raise ValueError(f"{text!r} needs 0 < START < STOP")
    return a, b


def from_dict(data: dict) -> FinetuneConfig:
    """Rebuild a config written by to_dict (the worker reads the launcher's plan)."""
    return build_config([data])
