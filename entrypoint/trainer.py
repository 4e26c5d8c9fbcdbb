"""The training loop: one object that owns what a step needs, in build order.

build: data (tokenize once, cache) -> sampler -> model (rank 0 reads weights, the others
build on meta) -> activation checkpointing -> FSDP2 -> weights broadcast -> AdamW +
warmup/cosine -> checkpointer. Then resume, fit (steps, logs, checkpoints), finish
(final checkpoint, HF export).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from contracts.collate import IGNORE_INDEX
from contracts.finetune_config import FinetuneConfig, parse_profile_steps
from entrypoint.batches import MicroBatch, build_micro_batch
from entrypoint.checkpoint import Checkpointer, export_hf, list_checkpoints
from entrypoint.data import Corpus, corpus_key, load_corpus, read_corpus, save_corpus
from entrypoint.metrics import FlopModel, IntervalMeter, MetricsWriter, device_peak_flops, flop_model
from entrypoint.model import load_model_for_sharding, load_tokenizer, materialize, resolve_attention
from entrypoint.parallelize import DTYPES, apply_activation_checkpointing, apply_fsdp
from entrypoint.profiling import StepProfiler
from entrypoint.sampler import PackedSampler


class Console:
    def __init__(self, rank: int):
        self.rank = rank

    def info(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[finetune] {msg}", flush=True)

    def every_rank(self, msg: str) -> None:
        print(f"[finetune rank{self.rank}] {msg}", file=sys.stderr, flush=True)


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup to 1, then cosine down to min_ratio at `total`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_ce_sum(logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed CE over [N, V] logits, `chunk` rows at a time, each chunk recomputed in
    backward. Unchunked, a 248k vocabulary at 8192 tokens keeps an fp32 copy of the
    logits and the fp32 log-softmax alive until backward (~16 GB); chunked, only the
    bf16 logits stay, plus one chunk's fp32 transients."""
    if chunk <= 0 or logits.shape[0] <= chunk:
        return _ce_sum(logits, labels)
    from torch.utils.checkpoint import checkpoint

    parts = [checkpoint(_ce_sum, a, b, use_reentrant=False) for a, b in zip(logits.split(chunk), labels.split(chunk))]
    return torch.stack(parts).sum()


def loss_sum(model, inputs: dict, labels: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Summed next-token CE over valid labels (shift inside: labels are unshifted, as the
    collators emit them). Summed, not averaged: the caller divides by the GLOBAL count."""
    logits = model(**inputs, use_cache=False).logits
    return chunked_ce_sum(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), chunk)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def load_corpus_once(cfg: FinetuneConfig, tokenizer, cache_dir: Path, rank: int) -> tuple[Corpus, bool]:
    """Rank 0 tokenizes and caches under output.dir; the other ranks load its file.
    Tokenizing ultrachat_200k takes minutes; every rank doing it at once takes longer.
    A node that cannot see the file (output.dir not shared) tokenizes for itself."""
    path = cache_dir / f"corpus-{corpus_key(cfg.data, tokenizer)}.npz"
    cached = path.exists()
    if rank == 0 and not cached:
        cache_dir.mkdir(parents=True, exist_ok=True)
        save_corpus(load_corpus(cfg.data, tokenizer), path)
    dist.barrier()
    if path.exists():
        return read_corpus(path), cached
    return load_corpus(cfg.data, tokenizer), False


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    n_loss: int
    n_real: int
    area: int
    sum_sq: int
    n_micro: int
    epoch: int
    data_s: float
    compute_s: float


@dataclass
class Trainer:
    cfg: FinetuneConfig
    plan: dict
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
    extra: dict = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return Path(self.cfg.output.dir)

    @property
    def packed(self) -> bool:
        return self.plan["packing"]["effective"] == "packed"

    @classmethod
    def build(cls, cfg: FinetuneConfig, plan: dict, rank: int, world: int, device: torch.device) -> Trainer:
        con = Console(rank)
        out = Path(cfg.output.dir)
        packed = plan["packing"]["effective"] == "packed"
        torch.manual_seed(cfg.train.seed)

        t0 = time.perf_counter()
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        corpus, cached = load_corpus_once(cfg, tokenizer, out / ".cache" / "corpus", rank)
        con.info(f"data: {len(corpus)} documents, {int(corpus.offsets[-1])} tokens from {corpus.n_rows} rows "
                 f"in {time.perf_counter() - t0:.1f}s{' (cached)' if cached else ''}; "
                 f"bad rows: {corpus.bad.counts or 'none'}, truncated: {corpus.bad.truncated} "
                 f"(policy overlong={cfg.data.overlong})")
        sampler = PackedSampler(corpus.lengths, "bfd" if packed else "padded", cfg.packing.budget,
                                cfg.packing.shuffle_window, cfg.train.seed, world, rank, cfg.train.grad_accum)

        lock_attn = (plan.get("lock") or {}).get("attn_implementation")
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                      weight_decay=t.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                      lr_lambda(t.warmup_steps, t.max_steps, t.min_lr_ratio))
        ckpt = Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, rank=rank, world_size=world)
        return cls(cfg=cfg, plan=plan, rank=rank, world=world, device=device, con=con, tokenizer=tokenizer,
                   corpus=corpus, sampler=sampler, model=model, optimizer=optimizer, scheduler=scheduler,
                   ckpt=ckpt, flops=flops, attn=attn, n_params=n_params)

    def resume(self) -> None:
        stale = self.ckpt.clean_stale()
        if stale:
            self.con.info(f"removed unfinished checkpoint dirs from a killed run: {stale}")
        mode = self.cfg.checkpoint.resume
        if mode == "never":
            return
        if mode == "auto":
            found = list_checkpoints(self.out / "checkpoints")
            if not found:
                return
            path = found[-1]
        else:
            path = Path(mode)
        state = self.ckpt.load(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = self.last_saved = int(state["step"])
        self.resumed_from = str(path)
        self.con.info(f"resumed from {path} at step {self.step}")

    def micro_batches(self) -> tuple[int, list[MicroBatch]]:
        epoch, bins = self.sampler.next_step()
        return epoch, [build_micro_batch(self.corpus, ids, packed=self.packed, budget=self.cfg.packing.budget,
                                         pad_token_id=self.tokenizer.pad_token_id) for ids in bins]

    def train_step(self) -> StepStats:
        td = time.perf_counter()
        epoch, mbs = self.micro_batches()
        counts = torch.tensor([sum(m.n_loss for m in mbs), sum(m.n_real for m in mbs), sum(m.area for m in mbs),
                               sum(sum(n * n for n in m.doc_lengths) for m in mbs)], dtype=torch.float64)
        dist.all_reduce(counts)  # float64 counts stay exact below 2^53
        n_loss, n_real, area, sum_sq = (int(x) for x in counts.tolist())
        data_s = time.perf_counter() - td

        tc = time.perf_counter()
        local_sum = torch.zeros((), device=self.device)
        for mb in mbs:
            ls = loss_sum(self.model, to_device(mb.inputs, self.device), mb.labels.to(self.device),
                          self.cfg.train.loss_chunk_tokens)
            # FSDP2 averages gradients over ranks; times `world` turns that average into the
            # sum, so the gradient is exactly d(sum of token losses)/d(theta) / global count.
            (ls * self.world / max(n_loss, 1)).backward()
            local_sum += ls.detach()
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(local_sum)
        loss = local_sum.item() / max(n_loss, 1)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return StepStats(loss=loss, grad_norm=float(grad_norm), n_loss=n_loss, n_real=n_real, area=area,
                         sum_sq=sum_sq, n_micro=len(mbs) * self.world, epoch=epoch, data_s=data_s,
                         compute_s=time.perf_counter() - tc)

    def fit(self) -> None:
        cfg = self.cfg
        metrics = MetricsWriter(self.out / "metrics.jsonl", enabled=self.rank == 0)
        peak = device_peak_flops(cfg.output.peak_tflops)
        window = parse_profile_steps(cfg.output.profile_steps) if cfg.output.profile_steps else None
        profiler = StepProfiler(window, self.out / "profile", self.rank, self.con.info)
        meter, interval_start = IntervalMeter(), time.perf_counter()
        while self.step < cfg.train.max_steps:
            self.step += 1
            profiler.before_step(self.step)
            s = self.train_step()
            profiler.after_step(self.step)
            self.last_loss = s.loss
            meter.add(s, self.flops.train_flops(s.n_real, s.sum_sq), cfg.packing.budget)
            if self.step % cfg.output.log_every == 0 or self.step == cfg.train.max_steps:
                rec = {"step": self.step, "epoch": s.epoch, "loss": s.loss, "loss_avg": meter.mean_loss(),
                       "lr": self.scheduler.get_last_lr()[0], "grad_norm": s.grad_norm, "loss_tokens": s.n_loss,
                       **meter.summary(time.perf_counter() - interval_start, self.world, peak)}
                metrics.write(rec)
                self.con.info(format_record(rec, cfg.train.max_steps))
                meter, interval_start = IntervalMeter(), time.perf_counter()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                t_save = time.perf_counter()
                self.save()
                saved_s = time.perf_counter() - t_save
                interval_start += saved_s  # checkpoint time is not step time
                self.con.info(f"checkpoint step {self.step} saved in {saved_s:.1f}s")
        profiler.close()

    def save(self) -> None:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(),
                 "data_fingerprint": self.corpus.fingerprint()}
        self.ckpt.save(self.step, self.model, self.optimizer, state)
        self.last_saved = self.step

    def finish(self) -> dict:
        if self.last_saved != self.step:
            self.save()
        exported = None
        if self.cfg.checkpoint.export:
            exported = export_hf(self.model, self.model.config, self.tokenizer, self.out / "final",
                                 dtype=DTYPES[self.cfg.checkpoint.export_dtype], rank=self.rank)
            if exported:
                self.con.info(f"exported HF safetensors to {exported}")
        c = self.corpus
        return {"final_loss": self.last_loss, "final_step": self.step, "resumed_from": self.resumed_from,
                "bad_rows": c.bad.to_dict(), "documents": len(c), "rows_read": c.n_rows,
                "tokens": int(c.offsets[-1]), "data_fingerprint": c.fingerprint(),
                "exported": str(exported) if exported else None, "world_size": self.world,
                "attn_implementation": self.attn, "n_params": self.n_params}


def format_record(rec: dict, max_steps: int) -> str:
    mfu = f"{rec['mfu'] * 100:.1f}%" if rec["mfu"] is not None else "n/a"
    return (f"step {rec['step']}/{max_steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
            f"tok/s {rec['tokens_per_s']:.0f} pad {rec['padding_ratio']:.1%} pack {rec['packing_efficiency']:.1%} "
            f"mfu {mfu} step {rec['step_time_s'] * 1e3:.0f}ms (data {rec['data_time_s'] * 1e3:.0f}ms)")
