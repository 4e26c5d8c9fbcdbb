"""The training loop: one object that owns what a step needs, in build order.

build: data (tokenized once by the launcher, before the ranks started) -> sampler -> model
(rank 0 reads weights, the others build on meta) -> activation checkpointing -> FSDP2 ->
weights broadcast -> AdamW + transformers' warmup/cosine-with-floor schedule ->
checkpointer. Then resume, fit (steps, logs, checkpoints; a stop request ends at the next
step boundary with a checkpoint), finish (final checkpoint, HF export).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from contracts.finetune_config import FinetuneConfig, parse_profile_steps
from entrypoint.batches import MicroBatch, build_micro_batch
from entrypoint.checkpoint import Checkpointer, CheckpointError, list_checkpoints
from entrypoint.console import Console
from entrypoint.data import Corpus, read_corpus
from entrypoint.export import export_hf
from entrypoint.metrics import FlopModel, IntervalMeter, MetricsWriter, device_peak_flops, flop_model
from entrypoint.model import load_model_for_sharding, load_tokenizer, materialize, resolve_attention
from entrypoint.parallelize import DTYPES, apply_activation_checkpointing, apply_fsdp
from entrypoint.plan import RunPlan
from entrypoint.profiling import StepProfiler
from entrypoint.sampler import PackedSampler
from entrypoint.step import NonFiniteLoss, PendingStep, StepOutcome, read_interval, run_step

__all__ = ["NonFiniteLoss", "Trainer", "schedule"]


def schedule(optimizer, cfg: FinetuneConfig):
    """transformers' warmup + cosine down to a floor (min_lr_rate). Its warmup starts at lr 0 at
    step 0: the first optimizer step runs at lr 0."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    t = cfg.train
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=t.warmup_steps,
                                                       num_training_steps=t.max_steps, min_lr_rate=t.min_lr_ratio)


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
    step: int = 0
    resumed_from: str | None = None
    last_loss: float = float("nan")
    last_saved: int = 0
    interrupted: bool = False
    stop_requested: object = None          # a callable() -> bool, set by the worker (SIGTERM)
    readback: object = None                # tensor -> list: the step's host sync (tests may observe it)
    pending: list[PendingStep] = field(default_factory=list)   # steps not yet read back (logged)

    @property
    def out(self) -> Path:
        return Path(self.cfg.output.dir)

    @classmethod
    def build(cls, cfg: FinetuneConfig, plan: RunPlan, rank: int, world: int, device: torch.device) -> Trainer:
        con = Console(rank)
        out = Path(cfg.output.dir)
        torch.manual_seed(cfg.train.seed)
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
        corpus = read_corpus(Path(plan.corpus))
        con.info(f"data: {len(corpus)} documents, {int(corpus.offsets[-1])} tokens from {corpus.n_rows} rows; "
                 f"bad rows: {corpus.bad.counts or 'none'}, truncated: {corpus.bad.truncated} "
                 f"(policy overlong={cfg.data.overlong})")
        sampler = PackedSampler(corpus.lengths, "bfd" if plan.packed else "padded", cfg.packing.budget,
                                cfg.packing.shuffle_window, cfg.train.seed, world, rank, cfg.train.grad_accum)

        lock_attn = (plan.lock or {}).get("attn_implementation")
        attn = resolve_attention(cfg.model.attn_implementation, lock_attn, device.type)
        model, full_sd = load_model_for_sharding(cfg.model.path, attn_implementation=attn, rank=rank,
                                                 world_size=world, trust_remote_code=cfg.model.trust_remote_code)
        flops = flop_model(model, model.config)  # shapes only, so meta tensors are fine
        n_params = sum(p.numel() for p in model.parameters())
        p = cfg.parallel
        n_ac = apply_activation_checkpointing(model, p.activation_checkpoint, p.ac_every)
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp(model, init_device_mesh(device.type, (world,)), param_dtype=p.param_dtype,
                   reduce_dtype=p.reduce_dtype, reshard_after_forward=p.reshard_after_forward)
        materialize(model, full_sd, device)
        del full_sd
        con.info(f"model: {n_params / 1e6:.2f}M params, attn={attn}, FSDP2 over {world} ranks, "
                 f"param_dtype={p.param_dtype}, AC on {n_ac} layers, batches={sampler.scheme}")

        t = cfg.train
        # fused: one kernel per parameter group instead of a dozen foreach launches per step
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                      weight_decay=t.weight_decay, fused=device.type == "cuda")
        ckpt = Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, rank=rank, world_size=world,
                            device=device)
        return cls(cfg=cfg, plan=plan, rank=rank, world=world, device=device, con=con, tokenizer=tokenizer,
                   corpus=corpus, sampler=sampler, model=model, optimizer=optimizer,
                   scheduler=schedule(optimizer, cfg), ckpt=ckpt, flops=flops, attn=attn, n_params=n_params)

    def resume(self) -> None:
        stale = self.ckpt.clean_stale()
        if stale:
            self.con.info(f"removed unfinished checkpoint dirs from a killed run: {stale}")
        mode = self.cfg.checkpoint.resume
        if mode == "never":
            return
        candidates = list(reversed(list_checkpoints(self.out / "checkpoints"))) if mode == "auto" else [Path(mode)]
        for path in candidates:
            try:
                state = self.ckpt.load(path, self.model, self.optimizer)
            except CheckpointError as exc:
                if mode != "auto":
                    raise
                # the newest may be damaged (a truncated shard): take the newest valid one
                self.con.info(f"WARNING: skipping checkpoint {path.name}: {str(exc).splitlines()[0]}")
                continue
            self.scheduler.load_state_dict(state["scheduler"])
            self.sampler.load_state_dict(state["sampler"])
            self.step = self.last_saved = int(state["step"])
            self.resumed_from = str(path)
            self.con.info(f"resumed from {path} at step {self.step}")
            return

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
                        stop=bool(self.stop_requested and self.stop_requested()), step=self.step, epoch=epoch,
                        data_s=time.perf_counter() - td, readback=self.readback)

    def fit(self) -> None:
        cfg = self.cfg
        metrics = MetricsWriter(self.out, enabled=self.rank == 0, tensorboard=cfg.output.tensorboard)
        peak = device_peak_flops(cfg.output.peak_tflops)
        window = parse_profile_steps(cfg.output.profile_steps) if cfg.output.profile_steps else None
        profiler = StepProfiler(window, self.out / "profile", self.rank, self.con.info)
        interval_start = time.perf_counter()
        started, first_step, step_seconds = time.perf_counter(), self.step, 0.0
        try:
            while self.step < cfg.train.max_steps:
                self.step += 1
                profiler.before_step(self.step)
                outcome = self.train_step()
                profiler.after_step(self.step)
                self.pending.append(outcome.pending)
                step_seconds += outcome.pending.data_s + outcome.pending.compute_s
                if self.step % cfg.output.log_every == 0 or self.step == cfg.train.max_steps or \
                        outcome.stop_requested:
                    wall = time.perf_counter() - interval_start
                    rec = self.log_interval(wall, peak)
                    metrics.write(rec)
                    done = self.step - first_step
                    eta = step_seconds / done * (cfg.train.max_steps - self.step) if done else None
                    self.con.step(rec, cfg.train.max_steps, time.perf_counter() - started, eta)
                    interval_start = time.perf_counter()
                if outcome.stop_requested:
                    self.interrupted = True
                    why = getattr(self.stop_requested, "signal_name", "") or "another rank"
                    self.con.info(f"stop requested ({why}): checkpointing at step {self.step}")
                    self.save()
                    return
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    t_save = time.perf_counter()
                    self.save()
                    saved_s = time.perf_counter() - t_save
                    interval_start += saved_s  # checkpoint time is not step time
                    self.con.info(f"checkpoint step {self.step} saved in {saved_s:.1f}s")
        finally:
            profiler.close()
            metrics.close()

    def log_interval(self, wall_s: float, peak: float | None) -> dict:
        """Read the interval's pending steps back (one sync) and summarise them for the log."""
        stats = read_interval(self.pending, self.device, self.step - len(self.pending) + 1)
        self.pending.clear()
        meter = IntervalMeter()
        for s in stats:
            meter.add(s, self.flops.train_flops(s.n_real, s.sum_sq), self.cfg.packing.budget)
        last = stats[-1]
        self.last_loss = last.loss
        return {"step": self.step, "epoch": last.epoch, "loss": last.loss, "loss_avg": meter.mean_loss(),
                "lr": self.scheduler.get_last_lr()[0], "grad_norm": last.grad_norm, "loss_tokens": last.n_loss,
                **meter.summary(wall_s, self.world, peak)}

    def save(self) -> None:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(),
                 "data_fingerprint": self.corpus.fingerprint()}
        self.ckpt.save(self.step, self.model, self.optimizer, state)
        self.last_saved = self.step

    def finish(self) -> dict:
        exported = None
        if not self.interrupted:
            if self.last_saved != self.step:
                self.save()
            if self.cfg.checkpoint.export:
                exported = export_hf(self.model, self.model.config, self.tokenizer, self.out / "final",
                                     dtype=DTYPES[self.cfg.checkpoint.export_dtype], rank=self.rank)
                if exported:
                    self.con.info(f"exported HF safetensors to {exported}")
        c = self.corpus
        return {"final_loss": self.last_loss, "final_step": self.step, "resumed_from": self.resumed_from,
                "interrupted": self.interrupted, "bad_rows": c.bad.to_dict(), "documents": len(c),
                "rows_read": c.n_rows, "tokens": int(c.offsets[-1]), "data_fingerprint": c.fingerprint(),
                "exported": str(exported) if exported else None, "world_size": self.world,
                "attn_implementation": self.attn, "n_params": self.n_params}
