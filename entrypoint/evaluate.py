"""Evaluation: a packed eval loss over the held-out documents' assistant tokens (the same masking
as training, a global token mean), early stopping, and greedy samples.

Every rank runs the same number of forward passes (FSDP2 all-gathers inside each one): the eval
micro-batches are dealt round-robin, and a rank with fewer gets a copy of one with no loss tokens.
Samples are generated the same way, in lockstep, for exactly eval.max_new_tokens tokens, with no
cache: no rank ever holds the full weights, and none can stop early and leave the others waiting.

An evaluation can run for hours (eval.samples x eval.max_new_tokens forward passes), so a stop
request is checked before every forward pass, all ranks deciding together: a stop on any rank
ends the evaluation on all of them (EvalInterrupted) and the trainer checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from contracts.collate import IGNORE_INDEX
from entrypoint.data.corpus import Corpus
from entrypoint.data.micro_batches import MicroBatch, build_micro_batch
from entrypoint.data.packing import pack_windows
from entrypoint.distributed import collectives
from entrypoint.loss import loss_sum, to_device


class EvalInterrupted(Exception):
    """A stop request (SIGTERM, SIGINT, the launcher gone) on some rank, during an evaluation."""


def check_stop(stop, device: torch.device) -> None:
    """Before a forward pass: every rank leaves together when any asked to stop."""
    if stop is not None and collectives.any_rank(bool(stop()), device):
        raise EvalInterrupted


@dataclass
class EvalState:
    """What the run remembers about its evaluations (saved in every checkpoint)."""

    best_loss: float | None = None
    best_step: int | None = None
    since_best: int = 0                  # evaluations since the best one
    history: list[tuple[int, float]] = field(default_factory=list)

    def update(self, step: int, loss: float) -> bool:
        """Record an eval; True when it is the best so far."""
        self.history.append((step, loss))
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.best_step, self.since_best = loss, step, 0
            return True
        self.since_best += 1
        return False

    def to_dict(self) -> dict:
        return {"best_loss": self.best_loss, "best_step": self.best_step, "since_best": self.since_best}

    @classmethod
    def from_dict(cls, data: dict | None) -> EvalState:
        data = data or {}
        return cls(best_loss=data.get("best_loss"), best_step=data.get("best_step"),
                   since_best=int(data.get("since_best", 0)))


def last_reply_start(labels: np.ndarray) -> int | None:
    """Where the document's last trained run (its last assistant reply) begins."""
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    if len(trained) == 0:
        return None
    gaps = np.flatnonzero(np.diff(trained) > 1)
    return int(trained[gaps[-1] + 1]) if len(gaps) else int(trained[0])


class Evaluator:
    def __init__(self, corpus: Corpus, *, packed: bool, budget: int, rank: int, world: int, device: torch.device,
                 pad_token_id: int, loss_chunk_tokens: int):
        self.corpus = corpus
        self.rank, self.world, self.device = rank, world, device
        self.loss_chunk_tokens = loss_chunk_tokens
        order = np.arange(len(corpus))
        bins = pack_windows(corpus.lengths, order, "bfd" if packed else "padded", budget, max(len(order), 1))
        self.batches: list[MicroBatch] = [build_micro_batch(corpus, b, packed=packed, budget=budget,
                                                            pad_token_id=pad_token_id) for b in bins]
        self.per_rank = -(-len(self.batches) // world)
        self.mine = self.batches[rank::world]

    def _padded(self) -> list[MicroBatch]:
        """This rank's batches, topped up with loss-free copies so every rank runs the same count."""
        filler = self.mine[0] if self.mine else self.batches[0]
        empty = MicroBatch(inputs=filler.inputs, labels=torch.full_like(filler.labels, IGNORE_INDEX),
                           n_real=0, area=filler.area, doc_lengths=[], n_loss=0)
        return self.mine + [empty] * (self.per_rank - len(self.mine))

    @torch.no_grad()
    def loss(self, model, stop=None) -> tuple[float, int]:
        """(eval loss, loss tokens) over every held-out document: a global per-token mean. `stop`:
        a callable() -> bool, checked before each micro-batch (EvalInterrupted)."""
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        try:
            for mb in self._padded():
                check_stop(stop, self.device)
                total += loss_sum(model, to_device(mb.inputs, self.device), mb.labels.to(self.device),
                                  self.loss_chunk_tokens).double()
                tokens += mb.n_loss
        finally:
            if was_training:
                model.train()
        summed = collectives.sum_across_ranks(torch.stack([total, torch.tensor(float(tokens), dtype=torch.float64,
                                                                                device=self.device)]),
                                              self.device).tolist()
        return (summed[0] / summed[1] if summed[1] else math.nan), int(summed[1])

    @torch.no_grad()
    def samples(self, model, tokenizer, n: int, max_new_tokens: int, stop=None) -> list[dict]:
        """Greedy completions of the first `n` held-out prompts (each document up to its last reply),
        generated in lockstep on every rank; rank 0 gets them all. `stop` as for loss(), checked
        before each generated token."""
        prompts = []
        for i in range(len(self.corpus)):
            start = last_reply_start(self.corpus.doc_labels(i))
            if start:
                prompts.append((i, start))
            if len(prompts) == n:
                break
        if not prompts:
            return []
        per_rank = -(-len(prompts) // self.world)
        mine = prompts[self.rank::self.world]
        work = mine + [prompts[0]] * (per_rank - len(mine))   # extra copies keep the ranks in step
        was_training = model.training
        model.eval()
        out = []
        try:
            for k, (i, start) in enumerate(work):
                ids = torch.as_tensor(self.corpus.doc_tokens(i)[:start].astype(np.int64), device=self.device)[None]
                new = []
                for _ in range(max_new_tokens):
                    check_stop(stop, self.device)
                    logits = model(input_ids=ids, use_cache=False).logits[:, -1]
                    token = logits.argmax(dim=-1, keepdim=True)
                    ids = torch.cat([ids, token], dim=1)
                    new.append(token)
                if k < len(mine):
                    generated = torch.cat(new, dim=1)[0].tolist()
                    out.append({"row": int(self.corpus.rows[i]),
                                "prompt": tokenizer.decode(self.corpus.doc_tokens(i)[:start].tolist()),
                                "completion": tokenizer.decode(generated, skip_special_tokens=False),
                                "reference": tokenizer.decode(self.corpus.doc_tokens(i)[start:].tolist())})
        finally:
            if was_training:
                model.train()
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, out)
        return [s for part in gathered for s in part] if self.rank == 0 else []
