"""What a checkpoint folder says about itself, read back as untrusted data.

trainer_state.json and the marker (.ftimage-checkpoint) are written by this tool, but a folder on
a shared volume can be truncated, edited or planted. Everything read back from them goes through
one typed read (the dataclasses below, through contracts/schema.py's engine: types, ranges,
patterns, unknown keys; a bool is never an int, "3" never a number), then through the checks
that tie the fields to each other, to the folder and to the run (cross_problems): the step is
the folder's number and at most the run's total steps; the scheduler stepped exactly that many
times; the world size is the marker's and every rank's RNG file is recorded; the sampler's
position is one the run's steps could have consumed; the fingerprint is a 16-digit hex digest
of the sampler's corpus; the eval state is one the run's evaluations could have left. The run
config it records is read by the config's own schema (FinetuneConfig). The folder's other files
are read as data the same way (read_contents): each rank's RNG file (rng_state.parse) and DCP's
metadata (safe_load.check_metadata). Every JSON file is bounded in size and nesting (json_limits).

A state that fails any of it raises StateInvalid naming the file, the field and what is wrong;
dcp.read_state reports that checkpoint as damaged (resume=auto then takes the newest valid one).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from contracts.finetune_config import RESUME_KEYS, FinetuneConfig
from contracts.folder_guard import read_bytes_nofollow
from contracts.schema import Problems, Reader, rule
from entrypoint.checkpoint import json_limits, rng_state
from entrypoint.checkpoint.safe_load import SafeFileSystemReader, UnsafeCheckpoint

TRAINER_STATE = "trainer_state.json"
MARKER = ".ftimage-checkpoint"
STATE_LIMIT = 64 << 20       # a trainer_state.json or rng file is KBs; a huge one is not ours
MAX_DEPTH = 16               # trainer_state.json nests 4 levels (run_config.data.sources[i].path)
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*|\.metadata")
PUBLIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# a checkpoint written before max_step_items was recorded: at most this many micro-batches a step
LEGACY_STEP_ITEMS = 1 << 20
SECTIONS = ("train", "packing", "data")
FIX = "restore the checkpoint from an intact copy, or resume another one"
DAMAGED_FIX = ("resume=auto skips it and takes the newest valid checkpoint (or point checkpoint.resume at another "
               "step-* folder); delete it to reclaim the space")
REFUSED_FIX = ("this checkpoint holds something other than training state; delete it, or resume from another one "
               "(checkpoint.resume)")


class StateInvalid(ValueError):
    """A checkpoint state file that is not what this tool writes: `file: field: problem`."""

    def __init__(self, file: str, where: str, problem: str, more: int = 0):
        self.file, self.field, self.problem = file, printable(where), printable(problem)
        super().__init__(f"{file}: " + (f"{self.field}: " if where else "") + self.problem +
                         (f" (and {more} more problem(s))" if more else ""))


def printable(text: str) -> str:
    """`text` on one line: a hostile key or value cannot break the report (or forge a log line)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class StateRefused(StateInvalid):
    """A file that asks to be loaded as something other than training state (DCP's metadata)."""


def _finite(value):
    if value is not None and not math.isfinite(value):
        return f"{value!r} is not a finite number", FIX
    return None


def _finite_rates(values: list[float]):
    if not values:
        return "is empty: a schedule has one rate per parameter group", FIX
    if any(not math.isfinite(v) or v < 0 for v in values):
        return f"{values!r} holds a rate that is negative or not finite", FIX
    return None


def _lambda_state(value):
    """A LambdaLR lambda's saved __dict__: transformers' schedules save {} (a functools.partial)."""
    if value is None:
        return None
    for key, item in value.items():
        if not PUBLIC_NAME.fullmatch(key) or not (item is None or isinstance(item, (str, int, float, bool))):
            return f"{key!r} is not a plain attribute of a schedule function", FIX
    return None


def _file_sizes(files: dict[str, int]):
    bad = next((name for name in files if not FILE_NAME.fullmatch(name) or name in (".", "..")), None)
    if bad is not None:
        return f"{bad!r} is not the name of a file in a checkpoint folder", FIX
    if any(size < 0 for size in files.values()):
        return "records a negative file size", FIX
    return None


@dataclass(kw_only=True)
class Marker:
    """.ftimage-checkpoint: written first, into the temp folder a save becomes."""

    step: int = field(metadata=rule(ge=0))
    world_size: int = field(metadata=rule(ge=1))


@dataclass(kw_only=True)
class SchedulerState:
    """torch's LambdaLR.state_dict(): load_state_dict sets every key as an attribute, so no other key."""

    base_lrs: list[float] = field(metadata=rule(check=_finite_rates))
    last_epoch: int = field(metadata=rule(ge=0))
    step_count: int = field(metadata=rule(key="_step_count", ge=0))
    last_lr: list[float] = field(metadata=rule(key="_last_lr", check=_finite_rates))
    lr_lambdas: list[dict[str, Any] | None] = field(metadata=rule(each=_lambda_state))
    is_initial: bool | None = field(default=None, metadata=rule(key="_is_initial"))
    get_lr_called_within_step: bool | None = field(default=None, metadata=rule(key="_get_lr_called_within_step"))
    verbose: bool | None = None    # older torch

    def to_torch(self) -> dict:
        keys = {"step_count": "_step_count", "last_lr": "_last_lr", "is_initial": "_is_initial",
                "get_lr_called_within_step": "_get_lr_called_within_step"}
        return {keys.get(k, k): v for k, v in asdict(self).items() if v is not None}


@dataclass(kw_only=True)
class SamplerState:
    """data.sampler.PackedSampler.state_dict()."""

    position: int = field(metadata=rule(ge=0))
    seed: int = field(metadata=rule(ge=0))
    scheme: Literal["bfd", "greedy", "padded"]
    budget: int = field(metadata=rule(ge=1))
    window: int = field(metadata=rule(ge=1))
    world_size: int = field(metadata=rule(ge=1))
    grad_accum: int = field(metadata=rule(ge=1))
    n_docs: int = field(metadata=rule(ge=1))
    n_tokens: int = field(metadata=rule(ge=1))


@dataclass(kw_only=True)
class Fingerprint:
    """data.corpus.Corpus.fingerprint(): the tokenized corpus's identity."""

    n_docs: int = field(metadata=rule(ge=1))
    n_tokens: int = field(metadata=rule(ge=1))
    sha256: str = field(metadata=rule(pattern=r"[0-9a-f]{16}", pattern_fix=FIX))


@dataclass(kw_only=True)
class EvalRecord:
    """evaluate.EvalState.to_dict()."""

    best_loss: float | None = field(default=None, metadata=rule(check=_finite))
    best_step: int | None = field(default=None, metadata=rule(ge=0))
    since_best: int = field(default=0, metadata=rule(ge=0))


@dataclass(kw_only=True)
class TrainerState:
    step: int = field(metadata=rule(ge=0))
    scheduler: SchedulerState
    sampler: SamplerState
    data_fingerprint: Fingerprint
    run_config: dict[str, Any]
    total_steps: int = field(metadata=rule(ge=0))
    complete: bool
    eval: EvalRecord
    early_stopped: bool
    world_size: int = field(metadata=rule(ge=1))
    files: dict[str, int] = field(metadata=rule(check=_file_sizes))
    max_step_items: int | None = field(default=None, metadata=rule(ge=1))   # absent before it was recorded
    rng: dict = field(init=False, default_factory=dict, repr=False)          # rank -> rng_state.RngState, as read
    rng_note: str = field(init=False, default="")

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("rng")
        out["scheduler"] = self.scheduler.to_torch()
        return out


def read(kind: type, raw: object, file: str):
    """An instance of `kind` from `raw`, or StateInvalid naming the first problem."""
    problems = Problems()
    value = Reader(file, problems).read(kind, raw)
    if problems or value is None:
        first = problems.items[0] if problems else None
        raise StateInvalid(file, first.field if first else "(file)", first.problem if first else "not readable",
                           max(len(problems) - 1, 0))
    return value


def read_marker(raw: object, folder_step: int, file: str) -> Marker:
    marker = read(Marker, raw, file)
    if marker.step != folder_step:
        raise StateInvalid(file, "step", f"{marker.step}, but the folder is step {folder_step}")
    return marker


def read_trainer_state(raw: object, *, folder_step: int, marker: Marker, file: str,
                       param_groups: int | None = None) -> TrainerState:
    """The typed state of a checkpoint folder numbered `folder_step`, checked against its marker
    and (when given) the optimizer's parameter groups; StateInvalid otherwise."""
    state = read(TrainerState, raw, file)
    problems = run_config_problems(state.run_config) + cross_problems(state, folder_step, marker, param_groups)
    if problems:
        where, problem = problems[0]
        raise StateInvalid(file, where, problem, len(problems) - 1)
    return state


def run_config_problems(run_config: dict[str, Any]) -> list[tuple[str, str]]:
    """The run config a checkpoint records (resume.run_config's keys), read by the config's schema."""
    nested: dict[str, dict] = {}
    for key, value in run_config.items():
        section, _, name = key.partition(".")
        recorded = section in SECTIONS and PUBLIC_NAME.fullmatch(name) and \
            (section != "train" or key in RESUME_KEYS)
        if not recorded:
            return [(f"run_config.{key}", "is not a key a checkpoint records")]
        nested.setdefault(section, {})[name] = value
    problems = Problems()
    Reader("run_config", problems).read(FinetuneConfig, nested, "run_config")
    return [(p.field, p.problem) for p in problems]


def cross_problems(s: TrainerState, folder_step: int, marker: Marker,
                   param_groups: int | None) -> list[tuple[str, str]]:
    """What the fields say about each other, the folder and the run."""
    found: list[tuple[str, str]] = []
    rc, sch, smp, ev = s.run_config, s.scheduler, s.sampler, s.eval

    def need(ok: bool, where: str, problem: str) -> None:
        if not ok:
            found.append((where, problem))

    need(s.step == folder_step, "step", f"{s.step}, but the folder is step {folder_step}")
    need(s.step <= s.total_steps, "step", f"{s.step} is past the run's total_steps {s.total_steps}")
    max_steps = rc.get("train.max_steps")
    need(not isinstance(max_steps, int) or s.total_steps <= max_steps, "total_steps",
         f"{s.total_steps} exceeds the run's train.max_steps {max_steps}")
    need(s.complete == (s.step >= s.total_steps or s.early_stopped), "complete",
         f"{s.complete}, but the run is at step {s.step} of {s.total_steps} (early_stopped {s.early_stopped})")
    need(marker.world_size == s.world_size, "world_size",
         f"{s.world_size}, but the folder's marker says {marker.world_size}")
    # the scheduler steps once per optimizer step
    need(sch.last_epoch == s.step, "scheduler.last_epoch", f"{sch.last_epoch}, but the checkpoint is step {s.step}")
    need(sch.step_count <= s.step + 1, "scheduler._step_count", f"{sch.step_count} exceeds step {s.step} + 1")
    groups = len(sch.base_lrs)
    need(len(sch.last_lr) == groups and len(sch.lr_lambdas) == groups, "scheduler",
         "base_lrs, _last_lr and lr_lambdas differ in length (one entry per parameter group)")
    need(param_groups is None or groups == param_groups, "scheduler.base_lrs",
         f"{groups} parameter group(s), but the optimizer has {param_groups}")
    # the sampler: this run's stream, at a position its steps could have reached
    need(smp.world_size == s.world_size, "sampler.world_size", f"{smp.world_size}, but the checkpoint was saved "
         f"by {s.world_size} ranks")
    fp = s.data_fingerprint
    need((smp.n_docs, smp.n_tokens) == (fp.n_docs, fp.n_tokens), "sampler.n_docs",
         f"{smp.n_docs} documents / {smp.n_tokens} tokens, but data_fingerprint says {fp.n_docs} / {fp.n_tokens}")
    for key, name, value in (("train.grad_accum", "grad_accum", smp.grad_accum), ("packing.budget", "budget",
                             smp.budget), ("packing.shuffle_window", "window", smp.window)):
        need(key not in rc or rc[key] == value, f"sampler.{name}", f"{value}, but the run's {key} is {rc.get(key)!r}")
    per_step = s.max_step_items or LEGACY_STEP_ITEMS
    need(s.max_step_items is None or s.max_step_items >= smp.world_size * smp.grad_accum, "max_step_items",
         f"{s.max_step_items} is below this save's own {smp.world_size} ranks x grad_accum {smp.grad_accum}")
    need(smp.position <= s.step * per_step, "sampler.position",
         f"{smp.position} micro-batches, more than {s.step} steps of at most {per_step} can have consumed")
    # evaluations: at most one per step, the best one at or before this step
    need((ev.best_loss is None) == (ev.best_step is None), "eval", "best_loss and best_step are not set together")
    need(ev.best_step is None or ev.best_step <= s.step, "eval.best_step", f"{ev.best_step} is after step {s.step}")
    need(ev.since_best <= s.step, "eval.since_best", f"{ev.since_best} evaluations in {s.step} steps")
    need(not s.early_stopped or ev.best_step is not None, "early_stopped", "true, but no evaluation was recorded")
    # the files: DCP's metadata and one RNG file per rank that saved
    need(".metadata" in s.files, "files", "does not record .metadata")
    if s.world_size > len(s.files):
        found.append(("world_size", f"{s.world_size} ranks, but only {len(s.files)} files are recorded"))
    else:
        missing = next((r for r in range(s.world_size) if f"rng-rank{r}.json" not in s.files), None)
        need(missing is None, "files", f"records no rng-rank{missing}.json, but {s.world_size} ranks saved")
    return found


def load_json(path: Path) -> object:
    """A state file's JSON: not followed through a symlink, bounded in size and in nesting."""
    try:
        raw = read_bytes_nofollow(path, STATE_LIMIT + 1)
    except OSError as exc:
        raise StateInvalid(path.name, "", f"unreadable ({exc.strerror or exc})") from None
    if len(raw) > STATE_LIMIT:
        raise StateInvalid(path.name, "", f"more than {STATE_LIMIT} bytes, not a file this tool writes")
    try:
        return json_limits.loads(raw, MAX_DEPTH)
    except json_limits.JsonRefused as exc:
        raise StateInvalid(path.name, "", str(exc)) from None


def read_states(folder: Path, folder_step: int, param_groups: int | None = None) -> TrainerState:
    """The marker and trainer_state.json of a step folder, typed and cross-checked."""
    marker = read_marker(load_json(folder / MARKER), folder_step, MARKER)
    return read_trainer_state(load_json(folder / TRAINER_STATE), folder_step=folder_step, marker=marker,
                              file=TRAINER_STATE, param_groups=param_groups)


def read_contents(folder: Path, state: TrainerState, ranks: Iterable[int] | None = None) -> None:
    """The RNG files of `ranks` (every rank that saved when None; kept in state.rng only when
    named) and DCP's metadata, each read and checked as data (rng_state.parse, safe_load)."""
    keep = ranks is not None
    for rank in (range(state.world_size) if ranks is None else ranks):
        if not 0 <= rank < state.world_size:
            continue
        name = f"rng-rank{rank}.json"
        try:
            parsed = rng_state.parse(load_json(folder / name), name)
        except rng_state.RngStateError as exc:
            raise StateInvalid(name, "", str(exc)) from None
        if keep:
            state.rng[rank] = parsed
    try:
        SafeFileSystemReader(str(folder)).read_metadata()
    except UnsafeCheckpoint as exc:
        raise StateRefused(".metadata", "", str(exc).splitlines()[0].replace(f"{folder}/", "")) from None
    except OSError as exc:
        raise StateInvalid(".metadata", "", f"unreadable ({exc.strerror or exc})") from None
