"""The finetune config schema: image defaults (from the lock) < user YAML < flags < KEY=VALUE.

A contract between build/ (which validates an image's finetune defaults with it, so bad
defaults fail the build rather than every job started from the image) and entrypoint/
(which trains with it). Every field is documented where it is declared. Loading collects
ALL problems (unknown keys with a did-you-mean, wrong types, values out of range) and
raises one ConfigError that lists each with a fix.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields_of
from pathlib import Path
from typing import Any, Literal

from contracts import safe_yaml
from contracts.schema import InvalidInput, Problem, Problems, Reader, rule

CONFIG_FILE_LABEL = "config"   # how problems from merged layers are attributed


class ConfigError(InvalidInput):
    title = "the finetune config"

    def __str__(self) -> str:
        shown = "\n".join(f"  {p.field}: {p.problem}\n    fix: {p.fix}" for p in self.problems[:self.SHOWN])
        more = len(self.problems) - self.SHOWN
        return "invalid finetune config:\n" + shown + (f"\n  ... and {more} more problem(s)" if more > 0 else "")


def _positive(name: str):
    return rule(ge=1, fix=f"set {name} to a positive integer")


def _non_negative(name: str):
    return rule(ge=0, fix=f"set {name} to 0 or more")


# The keys that change what a checkpoint means (resume refuses a change to one of them unless
# checkpoint.allow_changed lists it; see entrypoint/checkpoint/resume.py). `packing.*` and `data.*` stand for
# every key of those sections; `data.fingerprint` is the tokenized corpus's identity.
RESUME_KEYS: dict[str, str] = {
    "train.lr": "the schedule's peak learning rate",
    "train.max_steps": "the schedule's length (the cosine decays over it)",
    "train.warmup_steps": "the schedule's warmup",
    "train.min_lr_ratio": "the schedule's floor",
    "train.epochs": "when the run ends, and the schedule's length",
    "train.grad_accum": "tokens per optimizer step",
    "train.seed": "the data order, the held-out share and the mixture's draw",
    "packing.*": "which documents form each micro-batch",
    "data.*": "which documents the run trains on",
    "data.fingerprint": "the tokenized corpus itself (its documents and tokens: the files' content, the tokenizer)",
}


def dataclass_fields(kind) -> set[str]:
    return {f.name for f in dataclass_fields_of(kind)}


def _resume_key(value: str):
    sections = {"packing": PackingConfig, "data": DataConfig}
    section, _, name = value.partition(".")
    if value in RESUME_KEYS or (section in sections and (name == "*" or name in dataclass_fields(sections[section]))):
        return None
    close = difflib.get_close_matches(value, list(RESUME_KEYS), n=1)
    return (f"{value!r} is not a key a resume can change" + (f" (did you mean {close[0]}?)" if close else ""),
            f"list keys from the resume table: {', '.join(RESUME_KEYS)} (or data.<key>, packing.<key>)")


@dataclass(kw_only=True)
class ModelConfig:
    path: str = ""                        # local HF-format dir (mounted), or a hub id if the cluster has network
    tokenizer: str = ""                   # tokenizer dir/id; empty = same as path
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = "auto"  # auto = the lock's
    #                                       promise (flash_attention_2 on GPU images), else sdpa
    trust_remote_code: bool = False       # never needed for Qwen3.5 (native in transformers 5.x)


@dataclass(kw_only=True)
class SourceConfig:
    """One entry of data.sources: a source and its share of the documents."""

    path: str                             # a file, a folder of files, a glob or a save_to_disk folder
    weight: float = field(default=1.0, metadata=rule(gt=0.0, fix="give each source a positive weight: its share of "
                                                     "the documents (weights are normalised)"))  # share of documents
    format: Literal["auto", "jsonl", "json", "parquet", "arrow", "disk"] = "auto"
    schema: Literal["", "messages", "sharegpt", "alpaca", "text", "prompt_completion"] = ""  # "" = data.schema
    split: str = ""                       # a split of a local dataset folder ("" = every file)


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""                        # a file (.jsonl, .json, .parquet, .arrow), a folder of them, a glob,
    #                                       a save_to_disk folder, or a local dataset folder (with data.split)
    format: Literal["auto", "jsonl", "json", "parquet", "arrow", "disk"] = "auto"  # auto: from the file names
    schema: Literal["messages", "sharegpt", "alpaca", "text", "prompt_completion"] = "messages"  # row layout
    split: str = ""                       # the split to read from a dataset folder, e.g. train_sft ("" = all)
    sources: list[SourceConfig] = field(default_factory=list)  # a weighted mixture instead of data.path
    eval_path: str = ""                   # held-out data for evaluation (same forms as data.path)
    eval_fraction: float = field(default=0.0, metadata=rule(ge=0.0, le=0.5, fix="hold out a share of the documents "
                                 "between 0 and 0.5, e.g. 0.02, or set data.eval_path instead (0 = no evaluation "
                                 "data)"))  # or hold out
    #                                       this share of the documents (0 = none; at most 0.5)
    num_proc: int = field(default=0, metadata=rule(ge=0, le=256, fix="set data.num_proc in 0..256 (0 = one per "
                                                   "core, up to 16)"))  # tokenizer processes
    messages_field: str = "messages"      # column holding the list of {role, content}
    max_length: int = field(default=8192, metadata=_positive("data.max_length"))  # longest document in
    #                                       tokens; must be <= packing.budget
    overlong: Literal["truncate", "skip"] = "truncate"  # policy for rows longer than max_length
    end_of_turn: str = "auto"             # token that ends an assistant turn (in the loss); auto = <|im_end|> or eos
    max_rows: int = field(default=0, metadata=_non_negative("data.max_rows"))  # read at most this many rows
    #                                       (0 = all); for quick trials
    max_row_bytes: int = field(default=8 << 20, metadata=rule(ge=1024, le=1 << 30, fix="set data.max_row_bytes "
                                                               "between 1 KiB and 1 GiB"))  # a longer JSONL line
    #                                       is a counted bad row, never read into memory whole
    max_messages: int = field(default=4096, metadata=rule(ge=1, le=1 << 20, fix="set data.max_messages between 1 "
                                                          "and 1048576"))  # a row with more messages is a counted
    #                                       bad row, refused before it is rendered or tokenized
    max_row_group_bytes: int = field(default=1 << 30, metadata=rule(ge=1 << 20, le=1 << 36, fix="set "
                                     "data.max_row_group_bytes between 1 MiB and 64 GiB"))  # a parquet row group
    #                                       larger than this (uncompressed, from its metadata) is refused unread


@dataclass(kw_only=True)
class PackingConfig:
    mode: Literal["packed", "padded"] = "packed"  # 1D varlen rows, or the 2D baseline. Fallback forces padded.
    budget: int = field(default=8192, metadata=rule(ge=1, le=1 << 24, fix="set packing.budget in 1..16777216 "
                        "(cu_seqlens are int32)"))  # tokens per micro-batch
    shuffle_window: int = field(default=10000, metadata=_positive("packing.shuffle_window"))  # documents
    #                                       shuffled together and best-fit-decreasing packed per window


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = field(default=1000, metadata=_positive("train.max_steps"))  # optimizer steps
    grad_accum: int = field(default=1, metadata=_positive("train.grad_accum"))  # micro-batches per rank per step
    lr: float = field(default=2e-5, metadata=rule(gt=0.0, fix="set a positive learning rate, e.g. 2e-5"))  # peak
    min_lr_ratio: float = field(default=0.1, metadata=rule(ge=0.0, le=1.0, fix="set train.min_lr_ratio in "
                                                           "[0, 1]: the cosine floor as a fraction of lr"))
    warmup_steps: int = field(default=50, metadata=_non_negative("train.warmup_steps"))  # linear warmup from 0
    weight_decay: float = field(default=0.0, metadata=rule(ge=0.0, le=10.0, fix="set train.weight_decay in "
                                                           "[0, 10] (0.0 to 0.1 is usual)"))  # AdamW's decoupled
    #                                       decay: each step scales every weight by 1 - lr * weight_decay
    beta1: float = field(default=0.9, metadata=rule(ge=0.0, le=0.999999, fix="set train.beta1 in [0, 1)"))
    beta2: float = field(default=0.95, metadata=rule(ge=0.0, le=0.999999, fix="set train.beta2 in [0, 1)"))
    eps: float = field(default=1e-8, metadata=rule(ge=0.0, le=1.0, fix="set train.eps to a small positive "
                                                   "number, e.g. 1e-8"))
    grad_clip: float = field(default=1.0, metadata=rule(ge=0.0, fix="set train.grad_clip >= 0 (0 disables)"))
    seed: int = field(default=0, metadata=_non_negative("train.seed"))  # data order, init and RNG
    loss_chunk_tokens: int = field(default=4096, metadata=_non_negative("train.loss_chunk_tokens"))  # CE computed
    #                                       this many tokens at a time (recomputed in backward); 0 = all
    eval_every: int = field(default=0, metadata=_non_negative("train.eval_every"))  # evaluate every N steps
    #                                       (and at the end); needs data.eval_path or data.eval_fraction
    early_stopping_patience: int = field(default=0, metadata=_non_negative("train.early_stopping_patience"))
    #                                       stop after this many evals without a better eval loss (0 = never)
    epochs: int | None = field(default=None, metadata=rule(ge=1, fix="set train.epochs to 1 or more, or leave it "
                                                           "unset to let train.max_steps alone end the run"))
    #                                       passes over the data; the run ends at whichever of epochs and
    #                                       max_steps comes first (unset: max_steps alone)


@dataclass(kw_only=True)
class ParallelConfig:
    param_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"  # compute dtype of the all-gathered
    #                                       params (MixedPrecisionPolicy)
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # gradient reduce-scatter dtype
    activation_checkpoint: Literal["none", "full", "selective"] = "none"  # selective: every `ac_every`-th layer
    ac_every: int = field(default=2, metadata=_positive("parallel.ac_every"))
    reshard_after_forward: bool = True    # ZeRO-3 style; False keeps params gathered between fwd and bwd
    dp_replicate: int = field(default=1, metadata=_positive("parallel.dp_replicate"))  # HSDP: replicas of the
    #                                       sharded model (e.g. one per node); 1 = flat FSDP over every rank


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = field(default=500, metadata=_non_negative("checkpoint.every"))  # save a DCP checkpoint every
    #                                       N steps (0 = only at the end)
    keep: int = field(default=3, metadata=_positive("checkpoint.keep"))  # keep the newest k checkpoints
    resume: str = "auto"                  # auto (newest valid under output.dir) | never | PATH to a step dir
    export: bool = True                   # write HF safetensors (from_pretrained-loadable) at the end
    export_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    keep_best: bool = False               # keep the checkpoint with the best eval loss beside the newest `keep`
    async_save: bool = field(default=False, metadata=rule(key="async"))  # checkpoint.async: DCP's async save;
    #                                       training goes on while a checkpoint is written
    export_every: int = field(default=0, metadata=_non_negative("checkpoint.export_every"))  # also export HF
    #                                       safetensors every N steps, to output.dir/exports/step-N (0 = end only)
    allow_changed: list[str] = field(default_factory=list, metadata=rule(each=_resume_key))  # keys a resume may
    #                                       change (see entrypoint/checkpoint/resume.py); applied and logged


@dataclass(kw_only=True)
class EvalConfig:
    samples: int = field(default=0, metadata=rule(ge=0, le=1024, fix="set eval.samples in 0..1024"))  # greedy
    #                                       completions of held-out prompts written to samples.jsonl per eval
    max_new_tokens: int = field(default=64, metadata=rule(ge=1, le=4096, fix="set eval.max_new_tokens in "
                                                          "1..4096"))  # fixed length: every rank generates in lockstep


@dataclass(kw_only=True)
class OutputConfig:
    dir: str = "./finetune-out"           # checkpoints, metrics.jsonl, run_report.json, caches
    log_every: int = field(default=10, metadata=_positive("output.log_every"))  # steps per metrics line
    profile_steps: str = ""               # "a:b" = torch.profiler trace over steps [a, b)
    peak_tflops: float = field(default=0.0, metadata=rule(ge=0.0, le=1e6, fix="set output.peak_tflops in 0..1e6 "
                                                          "(0 = look the GPU up)"))  # per GPU, dense bf16
    tensorboard: bool = False             # alias for report_to: [tensorboard]
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=list)  # trackers that get
    #                                       every metric too; wandb/mlflow run offline unless configured
    #                                       (WANDB_MODE, MLFLOW_TRACKING_URI); metrics.jsonl is always written.
    #                                       A server each needs must answer within 10 s before any rank starts


@dataclass(kw_only=True)
class LaunchConfig:
    nproc_per_node: int = field(default=0, metadata=_non_negative("launch.nproc_per_node"))  # 0 = one per
    #                                       visible GPU, or 1 on CPU
    nnodes: int = field(default=0, metadata=_non_negative("launch.nnodes"))  # 0 = from $NNODES-style env, else 1
    rdzv: Literal["auto", "static", "c10d"] = "auto"  # auto: static on 1 node / c10d when RDZV_ENDPOINT is set
    master_port: int = field(default=0, metadata=rule(ge=0, le=65535, fix="set launch.master_port in 1..65535 "
                                                      "(0 = pick a free port)"))
    stop_grace_seconds: int = field(default=600, metadata=rule(ge=30, le=86400, fix="set launch.stop_grace_seconds "
                                                               "in 30..86400"))  # how long a stop signal may take:
    #                                       the deploy examples give the pods this grace period; size it from
    #                                       the logged checkpoint time (a stop waits for a save, then saves)
    timeout_minutes: int = field(default=30, metadata=rule(ge=1, le=24 * 60, fix="set launch.timeout_minutes "
                                                           "in 1..1440"))  # collective timeout: how long a
    #                                       rank waits for the others before the run fails


@dataclass(kw_only=True)
class FinetuneConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as its document: keys as a config file spells them (checkpoint.async)."""
        return _document(self)


def _document(obj) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {(f.metadata.get("key") or f.name): _document(getattr(obj, f.name)) for f in dataclass_fields_of(obj)}
    if isinstance(obj, list):
        return [_document(v) for v in obj]
    return obj


def parse_override(text: str) -> tuple[str, str]:
    """`train.lr=1e-4` -> ("train.lr", "1e-4"). The value stays text and is converted by the
    field's declared type: YAML-parsing it would turn `5:8` into the sexagesimal int 308."""
    if "=" not in text:
        raise ConfigError([Problem("command line", text, "override is not KEY=VALUE",
                                   "write e.g. train.max_steps=100", "bad-override")])
    key, raw = text.split("=", 1)
    return key.strip(), raw


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError([Problem("command line", dotted, f"{p} is not a section", "use section.key=value",
                                       "bad-override")])
    node[leaf] = value


def merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = safe_yaml.load_file(p)
    except safe_yaml.YamlRefused as exc:
        problem = "config file not found" if exc.code == "missing-file" else exc.problem
        where = f" at {exc.where}" if exc.where else ""
        raise ConfigError([Problem(str(p), "(file)", problem + where,
                                   "pass --config PATH to an existing YAML file" if exc.code == "missing-file"
                                   else exc.fix, exc.code)]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([Problem(str(p), "(file)", "top level is not a mapping",
                                   "write sections like `model:`, `data:`", "wrong-type")])
    return data


def build_config(layers: list[dict], *, file: str = CONFIG_FILE_LABEL, require_paths: bool = True) -> FinetuneConfig:
    """Merge raw dict layers (lowest priority first) into a validated FinetuneConfig."""
    raw: dict = {}
    for layer in layers:
        raw = merge(raw, layer)
    problems = Problems()
    cfg = Reader(file, problems, strings_convert=True).read(FinetuneConfig, raw)
    if cfg is not None:
        for where, problem, fix in cross_field_problems(cfg, require_paths=require_paths):
            if not problems.touches(file, where):
                problems.add(file, where, problem, fix)
    problems.raise_if_any(ConfigError)
    return cfg


def cross_field_problems(cfg: FinetuneConfig, *, require_paths: bool = True) -> list[tuple[str, str, str]]:
    problems = []
    if require_paths and not cfg.model.path:
        problems.append(("model.path", "not set", "set model.path to a mounted HF model directory"))
    d = cfg.data
    if require_paths and not d.path and not d.sources:
        problems.append(("data.path", "not set", "set data.path to a data file, folder or glob (or data.sources)"))
    if d.path and d.sources:
        problems.append(("data.sources", "set together with data.path", "use one: data.path for one source, or "
                         "data.sources (each with its path and weight) for a mixture"))
    if d.eval_path and d.eval_fraction:
        problems.append(("data.eval_fraction", "set together with data.eval_path", "use one: held-out data "
                         "(eval_path) or a held-out share of the training documents (eval_fraction)"))
    has_eval = bool(d.eval_path or d.eval_fraction)
    if cfg.train.eval_every and not has_eval:
        problems.append(("train.eval_every", f"{cfg.train.eval_every}, but there is no evaluation data",
                         "set data.eval_path or data.eval_fraction, or train.eval_every=0"))
    if (cfg.train.early_stopping_patience or cfg.checkpoint.keep_best or cfg.eval.samples) and \
            not cfg.train.eval_every:
        key = "train.early_stopping_patience" if cfg.train.early_stopping_patience else \
            "checkpoint.keep_best" if cfg.checkpoint.keep_best else "eval.samples"
        problems.append((key, "needs evaluations, but train.eval_every is 0", "set train.eval_every (and "
                         "data.eval_path or data.eval_fraction)"))
    t = cfg.train
    if t.lr * t.weight_decay > 1.0:   # inf past the float range: refused the same way
        problems.append(("train.lr", f"{t.lr:g} x train.weight_decay {t.weight_decay:g} = {t.lr * t.weight_decay:g} "
                         "exceeds 1: AdamW scales every weight by 1 - lr * weight_decay each step, which must stay "
                         "within [0, 1]", "lower train.lr or train.weight_decay until their product is at most 1 "
                         "(e.g. lr 2e-5 with weight_decay 0.1)"))
    if cfg.data.max_length > cfg.packing.budget:
        problems.append(("data.max_length", f"{cfg.data.max_length} exceeds packing.budget {cfg.packing.budget}",
                         "lower data.max_length or raise packing.budget; a document must fit one micro-batch"))
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


def provenance(named_layers: list[tuple[str, dict]]) -> dict[str, str]:
    """Dotted key -> the name of the layer that set it last (image default, file, flag, override)."""
    source: dict[str, str] = {}

    def walk(name: str, tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(name, value, dotted + ".")
            else:
                source[dotted] = name

    for name, layer in named_layers:
        walk(name, layer, "")
    return source
