"""The training loop: one object that owns what a step needs, in build order.

build: data (tokenized once by the launcher, before the ranks started) -> sampler -> model
(every rank builds it on meta, applies activation checkpointing and FSDP2, then reads only its
own shards of the HF safetensors: model.sharded_model) -> AdamW + transformers' warmup/cosine-with-floor schedule ->
checkpointer. Then resume (refusing what it would silently ignore, resume.py), fit (steps,
logs, checkpoints; a stop request, checked by all ranks together at every step, inside evaluations
and after saves and exports, ends it with a checkpoint), finish (final checkpoint, HF export, the
run's totals; a stop request waits for them). A stop request that comes while the model or a
checkpoint loads ends the run before its next step, with nothing to save (stopped_loading).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from contracts.finetune_config import FinetuneConfig, parse_profile_steps
from contracts.folder_guard import open_append_nofollow, real_dir
from entrypoint.checkpoint import resume as rs
from entrypoint.checkpoint.dcp import Checkpointer, CheckpointError, resume_candidates
from entrypoint.checkpoint.hf_safetensors import export as hf_export
from entrypoint.checkpoint.resume import run_config
from entrypoint.checkpoint.trainer_state import TrainerState
from entrypoint.data.corpus import Corpus, read_corpus
from entrypoint.data.micro_batches import MicroBatch, build_micro_batch
from entrypoint.data.sampler import PackedSampler
from entrypoint.distributed import collectives
from entrypoint.distributed.parallelize import DTYPES
from entrypoint.evaluate import EvalInterrupted, EvalState, Evaluator
from entrypoint.launcher.run_plan import RunPlan
from entrypoint.launcher.stop_request import hold
from entrypoint.model import load_tokenizer, resolve_attention, sharded_model
from entrypoint.observability.console import Console
from entrypoint.observability.flops import FlopModel, IntervalMeter, device_peak_flops, flop_model
from entrypoint.observability.profiling import StepProfiler
from entrypoint.observability.run_summary import AnonPeak, RunTotals, logged_loss
from entrypoint.observability.trackers import Metrics, drop_records_after, requested
from entrypoint.schedule import schedule, steps_for_epochs
from entrypoint.step import NonFiniteLoss, PendingStep, StepOutcome, read_interval, run_step

__all__ = ["NonFiniteLoss", "Trainer"]


@dataclass
class Trainer:
    cfg: FinetuneConfig
    plan: RunPlan
    rank: int
    world: int
    device: torch.device
    con: Console
    tokenizer: object
    corpus: Corpus
    sampler: PackedSampler
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ckpt: Checkpointer
    flops: FlopModel
    attn: str
    n_params: int
    total_steps: int                       # min(max_steps, the steps train.epochs makes)
    totals: RunTotals
    step: int = 0
    resumed_from: str | None = None
    last_loss: float = float("nan")
    last_saved: int = 0
    interrupted: bool = False
    stop_requested: object = None          # a callable() -> bool, set by the worker (SIGTERM)
    readback: object = None                # tensor -> list: the step's host sync (tests may observe it)
    pending: list[PendingStep] = field(default_factory=list)   # steps not yet read back (logged)
    evaluator: Evaluator | None = None     # held-out data (data.eval_path / data.eval_fraction)
    evals: EvalState = field(default_factory=EvalState)
    early_stopped: bool = False
    loading_stopped: str = ""              # what was loading when a stop request ended the run ("" = none did)
    max_step_items: int = 0                # most micro-batches (all ranks) a step of this data stream took

    @property
    def out(self) -> Path:
        return Path(self.cfg.output.dir)

    @classmethod
    def build(cls, cfg: FinetuneConfig, plan: RunPlan, rank: int, world: int, device: torch.device) -> Trainer:
        anon = AnonPeak()   # from the start: the load's peak is the one that matters at size
        con = Console(rank)
        out = Path(cfg.output.dir)
        torch.manual_seed(cfg.train.seed)
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
        corpus = read_corpus(Path(plan.corpus))
        con.info(f"data: {len(corpus)} documents, {corpus.n_tokens} tokens from {corpus.n_rows} rows; "
                 f"bad rows: {corpus.bad.counts or 'none'}, truncated: {corpus.bad.truncated} "
                 f"(policy overlong={cfg.data.overlong})")
        sampler = PackedSampler(corpus.lengths, "bfd" if plan.packed else "padded", cfg.packing.budget,
                                cfg.packing.shuffle_window, cfg.train.seed, world, rank, cfg.train.grad_accum)

        lock_attn = (plan.lock or {}).get("attn_implementation")
        attn = resolve_attention(cfg.model.attn_implementation, lock_attn, device.type)
        model, n_ac = sharded_model(cfg, attn=attn, device=device, world=world)
        flops = flop_model(model, model.config)
        n_params = sum(p.numel() for p in model.parameters())
        p = cfg.parallel
        layout = (f"HSDP {p.dp_replicate} replicas x {world // p.dp_replicate} shards" if p.dp_replicate > 1
                  else f"FSDP2 over {world} ranks")
        con.info(f"model: {n_params / 1e6:.2f}M params, attn={attn}, {layout}, param_dtype={p.param_dtype}, AC on "
                 f"{n_ac} layers, batches={sampler.scheme}")

        t = cfg.train
        by_epochs = steps_for_epochs(sampler, t.epochs, world, t.grad_accum)
        total_steps = min(t.max_steps, by_epochs) if by_epochs is not None else t.max_steps
        if by_epochs is not None:
            con.info(f"train.epochs={t.epochs}: {by_epochs} steps; the run ends after {total_steps} "
                     f"(max_steps {t.max_steps})")
        # fused: one kernel per parameter group instead of a dozen foreach launches per step
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                      weight_decay=t.weight_decay, fused=device.type == "cuda")
        ckpt = Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, rank=rank, world_size=world,
                            device=device, asynchronous=cfg.checkpoint.async_save, log=con.info,
                            grace_seconds=cfg.launch.stop_grace_seconds)
        totals = RunTotals(launched_at=plan.launched_at, world=world,
                           peak_flops=device_peak_flops(cfg.output.peak_tflops), anon=anon)
        evaluator = None
        if plan.eval_corpus:
            evaluator = Evaluator(read_corpus(Path(plan.eval_corpus)), packed=plan.packed, budget=cfg.packing.budget,
                                  rank=rank, world=world, device=device, pad_token_id=tokenizer.pad_token_id,
                                  loss_chunk_tokens=cfg.train.loss_chunk_tokens)
            con.info(f"evaluation: {len(evaluator.corpus)} held-out documents in {len(evaluator.batches)} "
                     f"micro-batches, every {cfg.train.eval_every} steps and at the end")
        totals.mark_host_peak("load")
        return cls(cfg=cfg, plan=plan, rank=rank, world=world, device=device, con=con, tokenizer=tokenizer,
                   corpus=corpus, sampler=sampler, model=model, optimizer=optimizer,
                   scheduler=schedule(optimizer, cfg, total_steps), ckpt=ckpt, flops=flops, attn=attn,
                   n_params=n_params, total_steps=max(total_steps, 0), totals=totals, evaluator=evaluator,
                   max_step_items=world * t.grad_accum)

    def resume(self) -> None:
        stale = self.ckpt.clean_stale()
        if stale:
            self.con.info(f"removed unfinished checkpoint dirs from a killed run: {stale}")
        mode = self.cfg.checkpoint.resume
        for path in resume_candidates(self.out / "checkpoints", mode):
            try:
                state = self.ckpt.load(path, self.model, self.optimizer)
            except CheckpointError as exc:
                if mode != "auto":
                    raise
                # the newest may be damaged (a truncated shard): take the newest valid one
                self.con.warn(f"skipping checkpoint {path.name}: {str(exc).splitlines()[0]}")
                continue
            self._apply(path, state)
            return

    def _apply(self, path: Path, state: TrainerState) -> None:
        """Continue from a loaded checkpoint (every field validated by read_state): its schedule and
        data position, unless the config changed a key the table lists and allow_changed applies
        it (the launcher refused the rest)."""
        step = state.step
        changed = rs.changes(state.run_config, rs.run_config(self.cfg, self.plan.packing.requested),
                             asdict(state.data_fingerprint), self.corpus.fingerprint())
        applied = rs.check(changed, list(self.cfg.checkpoint.allow_changed), path.name)
        if applied:
            self.con.warn(f"resuming {path.name} with checkpoint.allow_changed: "
                          + "; ".join(c.render() for c in applied))
        if rs.schedule_changed(applied):
            self.scheduler = schedule(self.optimizer, self.cfg, self.total_steps, at_step=step)
            self.con.info(f"the learning-rate schedule was rebuilt from step {step}: lr now "
                          f"{self.scheduler.get_last_lr()[0]:.3g}")
        else:
            self.scheduler.load_state_dict(state.scheduler.to_torch())
        if rs.stream_changed(applied):
            self.con.warn("the data changed: its stream starts again from the beginning (documents already "
                          "trained on may be seen again)")
        else:
            self.sampler.load_state_dict(asdict(state.sampler), allow_world_change=True)
            # the position a resumed step may reach: this stream's widest step so far
            self.max_step_items = max(self.max_step_items, state.max_step_items or
                                      state.sampler.world_size * state.sampler.grad_accum)
        if state.rng_note:
            self.con.every_rank(f"WARNING: {state.rng_note}")
        if state.world_size != self.world:
            self.con.warn(f"{path.name} was saved by {state.world_size} ranks and resumes on {self.world}: the "
                          "weights and optimizer state are resharded, the data stream continues at the same "
                          "global position")
        self.evals = EvalState.from_dict(asdict(state.eval))
        self.totals.best_eval_loss, self.totals.best_step = self.evals.best_loss, self.evals.best_step
        self.step = self.last_saved = step
        self.resumed_from = str(path)
        if self.plan.action == "finish":   # the final checkpoint: no more steps; its outcome and last loss
            self.early_stopped, self.last_loss = bool(state.early_stopped), logged_loss(
                self.out / "metrics.jsonl", step)
        if self.rank == 0:
            dropped = drop_records_after(self.out / "metrics.jsonl", step)
            if dropped:
                self.con.info(f"metrics.jsonl: dropped {dropped} record(s) after step {step}, logged again now")
        self.con.info(f"resumed from {path} at step {step}")

    def micro_batches(self) -> tuple[int, list[MicroBatch]]:
        epoch, bins = self.sampler.next_step()
        return epoch, [build_micro_batch(self.corpus, ids, packed=self.plan.packed, budget=self.cfg.packing.budget,
                                         pad_token_id=self.tokenizer.pad_token_id) for ids in bins]

    def train_step(self) -> StepOutcome:
        td = time.perf_counter()
        epoch, mbs = self.micro_batches()
        t = self.cfg.train
        return run_step(self.model, self.optimizer, self.scheduler, mbs, device=self.device, world=self.world,
                        grad_clip=t.grad_clip, loss_chunk_tokens=t.loss_chunk_tokens,
                        stop=self.stop_flag(), step=self.step, epoch=epoch,
                        data_s=time.perf_counter() - td, readback=self.readback)

    def fit(self) -> None:
        cfg = self.cfg
        metrics = Metrics(self.out, enabled=self.rank == 0, trackers=requested(cfg.output),
                          run_name=self.out.name, config=cfg.to_dict())
        window = parse_profile_steps(cfg.output.profile_steps) if cfg.output.profile_steps else None
        profiler = StepProfiler(window, self.out / "profile", self.rank, self.con.info)
        interval_start = time.perf_counter()
        started, first_step, step_seconds = time.perf_counter(), self.step, 0.0
        try:
            while self.step < self.total_steps:
                self.step += 1
                profiler.before_step(self.step)
                outcome = self.train_step()
                profiler.after_step(self.step)
                self.totals.first_step_done()
                self.ckpt.poll()   # commit an async checkpoint whose write has completed
                self.pending.append(outcome.pending)
                step_seconds += outcome.pending.data_s + outcome.pending.compute_s
                if self.step % cfg.output.log_every == 0 or self.step == self.total_steps or \
                        outcome.stop_requested:
                    rec = self.log_interval(time.perf_counter() - interval_start)
                    metrics.write(rec)
                    done = self.step - first_step
                    eta = step_seconds / done * (self.total_steps - self.step) if done else None
                    self.con.step(rec, self.total_steps, time.perf_counter() - started, eta)
                    interval_start = time.perf_counter()
                if outcome.stop_requested:
                    self.interrupted = True
                    self.save(wait=True)   # waits for a save in flight, then writes this one whole
                    return
                improved = boundary = False   # boundary: long work after the step, then a stop check
                if self.evaluator and cfg.train.eval_every and (self.step % cfg.train.eval_every == 0
                                                                or self.step == self.total_steps):
                    t_eval = time.perf_counter()
                    try:
                        improved, boundary = self.evaluate(metrics), True
                    except EvalInterrupted:
                        self.stop_here()
                        return
                    interval_start += time.perf_counter() - t_eval   # evaluation is not step time
                    if self.early_stopped:
                        self.save(wait=True)
                        return
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or \
                        (improved and cfg.checkpoint.keep_best):
                    t_save, boundary = time.perf_counter(), True
                    self.save()
                    interval_start += time.perf_counter() - t_save  # checkpoint time is not step time
                if cfg.checkpoint.export_every and self.step % cfg.checkpoint.export_every == 0 and \
                        self.step < self.total_steps:
                    t_export, boundary = time.perf_counter(), True
                    self.export(self.out / "exports" / f"step-{self.step:08d}")
                    interval_start += time.perf_counter() - t_export
                if boundary and collectives.any_rank(self.stop_flag(), self.device):
                    self.stop_here()
                    return
        finally:
            profiler.close()
            metrics.close()

    def stopped_loading(self, what: str) -> bool:
        """A stop request that came while `what` loaded, agreed by all ranks as at a step: the run
        ends before its next step, and saves nothing (nothing was trained since the last checkpoint)."""
        if not collectives.any_rank(self.stop_flag(), self.device):
            return False
        self.interrupted, self.loading_stopped = True, what
        self.con.info(f"stop requested while loading {what}: the run ends before step {self.step + 1}; nothing "
                      "was trained since the last checkpoint, so nothing is saved")
        return True

    def stop_flag(self) -> bool:
        """This rank's stop request (the worker's signal handler); the ranks agree on it in collectives."""
        return bool(self.stop_requested and self.stop_requested())

    def stop_here(self) -> None:
        """A stop request at a step boundary: this step's checkpoint (just written, or now)."""
        self.interrupted = True
        if self.last_saved == self.step:
            self.ckpt.wait()   # an async save of this step may still be in flight
        else:
            self.save(wait=True)

    def evaluate(self, metrics) -> bool:
        """Eval loss (and samples) at this step; early stopping. True when it is the best so far."""
        cfg = self.cfg
        loss, tokens = self.evaluator.loss(self.model, stop=self.stop_flag)
        improved = self.evals.update(self.step, loss)
        self.totals.best_eval_loss, self.totals.best_step = self.evals.best_loss, self.evals.best_step
        metrics.write({"step": self.step, "kind": "eval", "eval_loss": loss, "eval_tokens": tokens,
                       "eval_documents": len(self.evaluator.corpus)}, kind="eval")
        self.con.info(f"eval step {self.step}: loss {loss:.4f} over {tokens} tokens (best {self.evals.best_loss:.4f} "
                      f"at step {self.evals.best_step})")
        if cfg.eval.samples:
            samples = self.evaluator.samples(self.model, self.tokenizer, cfg.eval.samples, cfg.eval.max_new_tokens,
                                             stop=self.stop_flag)
            if self.rank == 0:
                with open_append_nofollow(self.out / "samples.jsonl") as fh:
                    for sample in samples:
                        fh.write(json.dumps({"step": self.step, **sample}, ensure_ascii=False) + "\n")
        patience = cfg.train.early_stopping_patience
        if patience and self.evals.since_best >= patience:
            self.early_stopped = True
            self.con.info(f"early stopping: {patience} evaluations without a better eval loss; best "
                          f"{self.evals.best_loss:.4f} at step {self.evals.best_step}")
        return improved

    def log_interval(self, wall_s: float) -> dict:
        """Read the interval's pending steps back (one sync) and summarise them for the log."""
        stats = read_interval(self.pending, self.device, self.step - len(self.pending) + 1)
        self.pending.clear()
        meter = IntervalMeter()
        for s in stats:
            meter.add(s, self.flops.train_flops(s.n_real, s.sum_sq), self.cfg.packing.budget)
        self.totals.add_interval(meter.steps, meter.real_tokens, meter.flops, wall_s)
        last = stats[-1]
        self.last_loss = last.loss
        return {"step": self.step, "epoch": last.epoch, "loss": last.loss, "loss_avg": meter.mean_loss(),
                "lr": self.scheduler.get_last_lr()[0], "grad_norm": last.grad_norm, "loss_tokens": last.n_loss,
                **meter.summary(wall_s, self.world, self.totals.peak_flops)}

    def save(self, *, wait: bool = False) -> None:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(),
                 "data_fingerprint": self.corpus.fingerprint(),
                 "run_config": run_config(self.cfg, self.plan.packing.requested),
                 "total_steps": self.total_steps, "complete": self.step >= self.total_steps or self.early_stopped,
                 "eval": self.evals.to_dict(), "early_stopped": self.early_stopped,
                 "max_step_items": max(self.max_step_items, self.world * self.cfg.train.grad_accum)}
        self.ckpt.save(self.step, self.model, self.optimizer, state,
                       protect=self.evals.best_step if self.cfg.checkpoint.keep_best else None, wait=wait)
        self.last_saved = self.step

    def export(self, out_dir: Path) -> Path | None:
        """The model as HF safetensors every rank writes its part of (hf_checkpoint.export)."""
        if self.rank == 0:
            real_dir(out_dir.parent)
        started = time.perf_counter()
        exported = hf_export(self.model, self.model.config, self.tokenizer, Path(self.cfg.model.path), out_dir,
                             dtype=DTYPES[self.cfg.checkpoint.export_dtype], rank=self.rank,
                             barrier=lambda: (hold("export"), self.ckpt.barrier()))   # hold: tests' window
        self.con.info(f"exported HF safetensors to {out_dir} in {time.perf_counter() - started:.1f}s")
        return exported

    def finish(self) -> dict:
        exported = None
        self.totals.mark_host_peak("steps")
        if not self.interrupted:
            if self.last_saved != self.step:
                self.save(wait=True)
            self.ckpt.wait()
            if self.cfg.checkpoint.export:
                exported = self.export(self.out / "final")
        self.totals.mark_host_peak("export")
        peaks: list = [None] * self.world
        dist.all_gather_object(peaks, self.totals.host_peaks)   # every rank's, into run_report.json
        c = self.corpus
        return {"final_loss": self.last_loss, "final_step": self.step, "resumed_from": self.resumed_from,
                "host_peak_gib": {phase: [p.get(phase) for p in peaks] for phase in ("load", "steps", "export")},
                "interrupted": self.interrupted, "bad_rows": c.bad.to_dict(), "documents": len(c),
                "rows_read": c.n_rows, "tokens": c.n_tokens, "data_fingerprint": c.fingerprint(),
                "exported": str(exported) if exported else None, "world_size": self.world,
                "attn_implementation": self.attn, "n_params": self.n_params, "total_steps": self.total_steps,
                "early_stopped": self.early_stopped, "stopped_while_loading": self.loading_stopped or None,
                "best_eval_loss": self.evals.best_loss,
                "best_step": self.evals.best_step, "summary": self.totals.to_dict()}
