"""finetune, as a library: config layers -> verify gate -> packing decision -> run plan.

The CLI calls `prepare` and execs the returned argv. Tests call it too.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from contracts.atomic import TMP_PREFIX
from contracts.errors import FixableError
from contracts.finetune_config import FinetuneConfig, build_config, parse_override, provenance, read_yaml, set_dotted
from contracts.folder_guard import UnsafeFolder, is_real_dir, is_real_file, read_bytes_nofollow, real_dir
from contracts.lock import LockError, load_lock, lock_path
from entrypoint.checkpoint import resume as rs
from entrypoint.data.sources import DataError
from entrypoint.distributed.mesh import MeshError, mesh_plan
from entrypoint.info import lock_summary_dict
from entrypoint.inputs import InputError, check_remote_code
from entrypoint.launcher.output_dir import ephemeral_warning, resolve_output_dir
from entrypoint.launcher.run_plan import PackingDecision, RunPlan
from entrypoint.launcher.torchrun import LaunchError, cache_env, resolve_topology, torchrun_argv, worker_env
from entrypoint.launcher.verify_gate import GateOutcome, run_verify
from entrypoint.observability import trackers
from entrypoint.observability.console import ALLOW_FALLBACK_ENV
from entrypoint.observability.tracker_check import TrackerUnavailable, check, process_env

EXIT_GATE = 3  # verify did not pass and --allow-fallback was not given


class FinetuneError(FixableError):
    def __init__(self, message: str, fix: str, exit_code: int = 2):
        super().__init__(message, fix)
        self.exit_code = exit_code   # 2 (finetune_cli.EXIT_USAGE), or EXIT_GATE when verify did not pass


@dataclass(frozen=True, kw_only=True)
class Launch:
    argv: list[str]
    env: dict
    plan_path: Path
    plan: RunPlan


def lock_layer(log: Callable[[str], None]) -> tuple[dict, dict | None]:
    """The image's finetune_defaults (lowest config layer) and a lock summary for the report.
    Outside an image there is no lock: defaults only, and we say so."""
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


def config_layers(config_file: str | None, overrides: list[str], defaults: dict,
                  flags: list[str] = ()) -> list[tuple[str, dict]]:
    """The named layers, lowest first: image default < file < flag < KEY=VALUE override."""
    user = read_yaml(config_file) if config_file else {}
    layers = [("image default", defaults), (f"file {config_file}" if config_file else "file", user)]
    for name, items in (("flag", flags), ("override", overrides)):
        tree: dict = {}
        for text in items:
            key, value = parse_override(text)
            set_dotted(tree, key, value)
        layers.append((name, tree))
    return layers


def resolve_config(config_file: str | None, overrides: list[str], defaults: dict,
                   flags: list[str] = ()) -> FinetuneConfig:
    return build_config([layer for _, layer in config_layers(config_file, overrides, defaults, flags)])


def print_config(config_file: str | None, overrides: list[str], flags: list[str], log=print) -> str:
    """The merged config, each key with the layer that set it (`finetune --print-config`)."""
    defaults, _ = lock_layer(lambda _m: None)
    layers = config_layers(config_file, overrides, defaults, flags)
    cfg = build_config([layer for _, layer in layers], require_paths=False)
    source = provenance(layers)
    lines = []

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, dotted + ".")
            else:
                lines.append(f"{dotted:<34} {json.dumps(value):<28} {source.get(dotted, 'built-in default')}")

    walk(cfg.to_dict(), "")
    return "\n".join([f"{'KEY':<34} {'VALUE':<28} SET BY", *lines, mesh_line(cfg)])


def mesh_line(cfg: FinetuneConfig) -> str:
    """The mesh and per-GPU state for --print-config (the world size as the launch would resolve it)."""
    try:
        world = resolve_topology(cfg, dict(os.environ))
        return mesh_plan(cfg, world.nnodes * world.nproc_per_node).render()
    except (MeshError, LaunchError) as exc:
        return f"mesh: {str(exc).splitlines()[0]}"


def decide_packing(requested: str, gate: GateOutcome) -> PackingDecision:
    if gate.passed or requested == "padded":
        return PackingDecision(requested=requested, effective=requested,
                               reason="verify passed" if gate.passed else "padded requested")
    # Fallback kernels ignore cu_seqlens / seq_idx (transformers' torch references take **kwargs
    # and drop them): packed rows would let every document attend to and convolve with the
    # previous one. 2D padded batches are exact on every backend.
    return PackingDecision(requested=requested, effective="padded",
                           reason="verify did not pass (--allow-fallback): packed rows would leak context across "
                                  "documents on fallback kernels, so batches are 2D padded")


def check_writable(output_dir: str) -> None:
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        # a probe of its own: every node of a multi-node run probes the same shared output.dir,
        # and one fixed name let one node delete the probe another was about to remove
        with tempfile.TemporaryFile(dir=output_dir, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise FinetuneError(f"output.dir {output_dir} is not writable: {exc}",
                            "mount a writable volume and set output.dir (or --output-dir) to it") from None


def check_inputs(cfg: FinetuneConfig, log: Callable[[str], None]) -> None:
    """Everything about the job's inputs that can be refused before verify and before any rank:
    output.dir (resolved once, a boundary), the data's kind, the model folder, remote code."""
    try:
        cfg.output.dir = str(resolve_output_dir(cfg.output.dir))
    except UnsafeFolder as exc:
        raise FinetuneError.from_error(exc) from None
    if warning := ephemeral_warning(Path(cfg.output.dir)):
        log(f"[finetune] WARNING: {warning}")
    model = Path(cfg.model.path)
    if model.exists() and not (model / "config.json").is_file():
        raise FinetuneError(f"model.path {model} has no config.json",
                            "point model.path at a HF-format model directory (config.json, *.safetensors)")
    if not model.exists() and (model.is_absolute() or cfg.model.path.startswith(".")):
        raise FinetuneError(f"model.path {model} does not exist",
                            "mount the model directory into the container and set model.path to it")
    # numpy (these two) and torch (dcp, model) are imported late: a config error exits without them
    from entrypoint.checkpoint.hf_safetensors import SourceCheckpointError, check_source
    from entrypoint.data.corpus_build import resolve_all

    try:
        resolve_all(cfg.data)   # every source's files, before verify and before any rank
        check_remote_code([cfg.model.path, cfg.model.tokenizer], cfg.model.trust_remote_code)
        if model.is_dir():
            check_source(model)  # every shard present and whole, before any rank allocates the model
    except InputError as exc:
        raise FinetuneError(str(exc), exc.fix) from None
    except SourceCheckpointError as exc:
        raise FinetuneError.from_error(exc) from None
    except DataError as exc:
        raise FinetuneError.from_error(exc) from None
    for name in trackers.missing(cfg.output):
        raise FinetuneError(f"output.report_to asks for {name}, but the {name} package is not installed in this "
                            "image", f"add {trackers.INSTALL[name]} to the image's python.requirements and rebuild, "
                            f"or drop {name} from output.report_to (metrics.jsonl is always written)")
    check_writable(cfg.output.dir)


def check_trackers(cfg: FinetuneConfig, env: dict) -> None:
    """Each tracker in output.report_to can start, asked within tracker_check.TIMEOUT_S seconds."""
    try:
        check(trackers.requested(cfg.output), env)
    except TrackerUnavailable as exc:
        raise FinetuneError(str(exc), exc.fix) from None


def check_mesh(cfg: FinetuneConfig, world: int) -> None:
    """parallel.dp_replicate must divide the world size, and the state per GPU must fit the GPU."""
    try:
        mesh_plan(cfg, world, check_fit=True)
    except MeshError as exc:
        raise FinetuneError.from_error(exc) from None


def preflight_resume(cfg: FinetuneConfig, log: Callable[[str], None]) -> dict | None:
    """The checkpoint the workers will resume from (its trainer state), checked before verify and
    before any rank: a changed key from the resume table is refused here (exit 2)."""
    from entrypoint.checkpoint.dcp import CheckpointError, newest_valid  # imports torch: as in check_inputs

    try:
        found = newest_valid(Path(cfg.output.dir) / "checkpoints", cfg.checkpoint.resume)
    except CheckpointError as exc:
        raise FinetuneError.from_error(exc) from None
    if found is None:
        return None
    path, state = found   # every field validated (checkpoint/trainer_state.py); a damaged one was skipped
    try:
        applied = rs.check(rs.changes(state.run_config, rs.run_config(cfg)),
                           list(cfg.checkpoint.allow_changed), path.name)
    except rs.ResumeRefused as exc:
        raise FinetuneError.from_error(exc) from None
    return {**state.to_dict(), "path": str(path), "changes": [c.render() for c in applied]}


def warn_about(cfg: FinetuneConfig, corpus_path: Path, world: int, log: Callable[[str], None]) -> None:
    """What would make the run say one thing and do another, said before it starts."""
    from entrypoint.data.corpus import read_corpus  # numpy: as in check_inputs
    from entrypoint.data.sampler import PackedSampler

    t = cfg.train
    if t.warmup_steps >= t.max_steps:
        log(f"[finetune] WARNING: train.warmup_steps ({t.warmup_steps}) >= train.max_steps ({t.max_steps}): the "
            f"learning rate never reaches train.lr ({t.lr:g}); lower warmup_steps (e.g. {max(1, t.max_steps // 10)})")
    corpus = read_corpus(corpus_path)
    bad = corpus.bad.skipped
    if corpus.n_rows and bad / corpus.n_rows > 0.10:
        log(f"[finetune] WARNING: {bad} of {corpus.n_rows} rows ({bad / corpus.n_rows:.0%}) are bad and not trained "
            f"on ({corpus.bad.counts}); `inspect-data` shows why")
    sampler = PackedSampler(corpus.lengths, "bfd" if cfg.packing.mode == "packed" else "padded",
                            cfg.packing.budget, cfg.packing.shuffle_window, t.seed, world, 0, t.grad_accum)
    needed = world * t.grad_accum
    if len(sampler.epoch_bins(0)) < needed:
        log(f"[finetune] WARNING: the data makes {len(sampler.epoch_bins(0))} micro-batch(es) per epoch, fewer than "
            f"one step needs ({world} ranks x grad_accum {t.grad_accum}); every step repeats documents. Add data, "
            "or lower grad_accum or the number of ranks")


def prepare(*, config_file: str | None, overrides: list[str], allow_fallback: bool, env: dict,
            log: Callable[[str], None] = print, gate: Callable[..., GateOutcome] = run_verify,
            flags: list[str] = (), events=None) -> Launch | None:
    launched_at = time.time()
    defaults, lock = lock_layer(log)
    layers = config_layers(config_file, overrides, defaults, flags)
    cfg = build_config([layer for _, layer in layers])
    check_inputs(cfg, log)
    try:
        topo = resolve_topology(cfg, env)     # a world size the GPUs cannot hold is refused before verify
        caches = cache_env(cfg, env)
    except LaunchError as exc:
        raise FinetuneError.from_error(exc) from None
    check_mesh(cfg, topo.nnodes * topo.nproc_per_node)
    resumed = preflight_resume(cfg, log)
    action = "train"
    if resumed and resumed.get("complete") and not resumed["changes"]:
        missing = unpublished(cfg, resumed)
        if not missing:
            log(f"[finetune] already complete: {resumed['path']} is step {resumed['step']} of "
                f"{resumed.get('total_steps')}; nothing to do (to train further: raise train.max_steps with "
                "checkpoint.allow_changed=[train.max_steps], or use a new output.dir)")
            return None
        action = "finish"
        log(f"[finetune] {Path(resumed['path']).name} is the run's final checkpoint, but {'; '.join(missing)}: "
            "finishing the run from it (no more training)")

    check_trackers(cfg, env)
    log("[finetune] running verify (the run stops unless it passes)")
    model_dir = cfg.model.path if (Path(cfg.model.path) / "config.json").is_file() else None
    with process_env(caches):  # verify imports transformers/triton: keep caches writable
        outcome = gate(model=model_dir, param_dtype=cfg.parallel.param_dtype)
    if not outcome.passed:
        log(outcome.table)
        if not allow_fallback:
            raise FinetuneError(
                f"verify did not pass (worst: {outcome.worst}); refusing to train on unverified kernels",
                "fix the failing checks above, or pass --allow-fallback (FTIMAGE_ALLOW_FALLBACK=1) to train "
                "anyway on the fallback path with 2D padded batches (recorded in run_report.json)", exit_code=EXIT_GATE)
        log(f"[finetune] WARNING: verify did not pass (worst: {outcome.worst}); --allow-fallback given, "
            "continuing ON THE RECORD with 2D padded batches")
    packing = decide_packing(cfg.packing.mode, outcome)
    cfg.packing.mode = packing.effective
    with process_env(caches):
        built = build_corpus(cfg, log, events)
    if resumed:
        check_fingerprint(cfg, resumed, built.train)
    warn_about(cfg, built.train, topo.nnodes * topo.nproc_per_node, log)
    plan = RunPlan(config=cfg, config_file=config_file, overrides=list(overrides), verify=outcome.to_dict(),
                   allow_fallback=bool(allow_fallback and not outcome.passed), allow_fallback_flag=bool(allow_fallback),
                   packing=packing, lock=lock, topology=topo.__dict__, corpus=str(built.train),
                   eval_corpus=str(built.eval or ""),
                   provenance=provenance(layers), launched_at=launched_at, action=action)
    try:
        launch_dir = real_dir(Path(cfg.output.dir) / ".launch")
    except UnsafeFolder as exc:
        raise FinetuneError.from_error(exc) from None
    plan_path = plan.write(launch_dir / f"plan-node{topo.node_rank}.json")
    wenv = worker_env(cfg, topo, {**env, **caches})
    if plan.allow_fallback:   # the runtime guard in every worker honours the same override, logged there
        wenv[ALLOW_FALLBACK_ENV] = "1"
    return Launch(argv=torchrun_argv(topo, plan_path), env=wenv, plan_path=plan_path, plan=plan)


def unpublished(cfg: FinetuneConfig, resumed: dict) -> list[str]:
    """What a run whose final checkpoint is saved has not published yet: a run is complete only
    with the final checkpoint, the HF export (checkpoint.export) and a run report that says so."""
    out, missing = Path(cfg.output.dir), []
    if cfg.checkpoint.export and not is_real_file(out / "final" / "config.json"):
        missing.append("final/ (the HF export) was never published")
    elif cfg.checkpoint.export and is_real_dir(out / f"{TMP_PREFIX}final"):   # the export replaces it
        missing.append(f"an export was cut short ({TMP_PREFIX}final)")
    try:   # never through a planted symlink, and bounded: the report is this run's own small file
        report = json.loads(read_bytes_nofollow(out / "run_report.json", 64 << 20))
    except (OSError, ValueError, RecursionError):
        report = {}
    if not isinstance(report, dict):
        report = {}
    if report.get("status") not in ("completed", "early_stopped") or report.get("final_step") != resumed["step"]:
        missing.append("run_report.json does not say it completed")
    return missing


def check_fingerprint(cfg: FinetuneConfig, resumed: dict, corpus_path: Path) -> None:
    from entrypoint.data.corpus import read_corpus  # numpy: as in check_inputs

    # a changed train.seed or data key was named (and allowed) by preflight_resume: the corpus it
    # changes is not refused a second time under its fingerprint
    change = rs.changes(rs.corpus_keys(resumed.get("run_config", {})), rs.corpus_keys(rs.run_config(cfg)),
                        resumed.get("data_fingerprint"), read_corpus(corpus_path).fingerprint())
    try:
        rs.check(change, list(cfg.checkpoint.allow_changed), Path(resumed["path"]).name)
    except rs.ResumeRefused as exc:
        raise FinetuneError.from_error(exc) from None


def build_corpus(cfg: FinetuneConfig, log: Callable[[str], None], events=None):
    """Tokenize once, here, before any rank starts: no rank waits on another (and on the process
    group's timeout) while rank 0 tokenizes. The workers memory-map the result (corpus_build.py)."""
    # numpy and torch: as in check_inputs; transformers loads here, inside the caller's process_env(caches)
    from entrypoint.data.corpus import read_corpus
    from entrypoint.data.corpus_build import build
    from entrypoint.model import ModelError, load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
        cache = real_dir(real_dir(Path(cfg.output.dir) / ".cache") / "corpus")
        built = build(cfg, tokenizer, cache, log=log, events=events)
        corpus = read_corpus(built.train)
        if len(corpus) == 0:
            raise DataError(f"no usable rows in the training data ({corpus.n_rows} read; bad: {corpus.bad.counts})",
                            f"check that the rows match data.schema={cfg.data.schema} (inspect-data shows each "
                            "row's verdict)")
        if built.eval is not None and len(read_corpus(built.eval)) == 0:
            raise DataError("the evaluation data holds no usable document", "check data.eval_path, or raise "
                            "data.eval_fraction", "data.eval_path" if cfg.data.eval_path else "data.eval_fraction")
    except (DataError, ModelError, UnsafeFolder, InputError) as exc:
        raise FinetuneError.from_error(exc) from None
    log(f"[finetune] data: {len(corpus)} documents, {corpus.n_tokens} tokens from {corpus.n_rows} rows; "
        f"bad rows: {corpus.bad.counts or 'none'}, truncated: {corpus.bad.truncated}"
        + (f", reasoning not rendered by the template: {corpus.bad.reasoning_dropped}"
           if corpus.bad.reasoning_dropped else "")
        + (f"; evaluation: {len(read_corpus(built.eval))} documents" if built.eval else ""))
    return built
