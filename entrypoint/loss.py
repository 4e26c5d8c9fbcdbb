"""The training loss: summed next-token cross-entropy over valid labels, chunked so a large
vocabulary never materialises an fp32 copy of all the logits."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from contracts.collate import IGNORE_INDEX


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_ce_sum(logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed CE over [N, V] logits, `chunk` rows at a time, each chunk recomputed in
    backward. Unchunked, a 248k vocabulary at 8192 tokens keeps an fp32 copy of the
    logits and the fp32 log-softmax alive until backward (~16 GB); chunked, only the
    bf16 logits stay, plus one chunk's fp32 transients."""
    if chunk <= 0 or logits.shape[0] <= chunk:
        return _ce_sum(logits, labels)
    parts = [checkpoint(_ce_sum, a, b, use_reentrant=False) for a, b in zip(logits.split(chunk), labels.split(chunk))]
    return torch.stack(parts).sum()


def loss_sum(model, inputs: dict, labels: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Summed next-token CE over valid labels (shift inside: labels are unshifted, as the
    collators emit them). Summed, not averaged: the caller divides by the GLOBAL count."""
    logits = model(**inputs, use_cache=False).logits
    return chunked_ce_sum(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), chunk)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
