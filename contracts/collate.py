"""The packed-batch contract: one fixed-size row with every boundary signal the kernels need.

entrypoint/ trains on these rows and verify/ proves isolation on the very same rows, so
the format has one definition, here. What has to reach each kernel:
  * flash-attn varlen: cu_seq_lens_q/k (int32) and max_length_q/k;
  * fla chunk_gated_delta_rule: cu_seqlens (transformers passes cu_seq_lens_q as cu_seqlens;
    fla then needs batch size 1, which a packed row is);
  * causal-conv1d: seq_idx, int32 (B, T). transformers never builds it itself, so the collator
    must, and it travels down the model's **kwargs to the GDN layer's causal_conv1d_fn call.
    Without it the width-4 conv leaks the previous document's last 3 tokens (transformers #46851,
    #46093; NeMo Automodel PR #2147).
position_ids restart at 0 per document; they stay 2-D (1, T). Qwen3.5 expands them to its 3-D
MRoPE layout itself, and hand-built 3-D ids misread as boundaries crashed flash-attn (transformers
PR #44911).

The row is padded to `budget` with ONE masked dummy document so every step has the same shapes
(no recompiles, stable memory) and the padding never attends to, or is convolved with, a real
document.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # label of a token that carries no loss (torch cross_entropy's default)


@dataclass(frozen=True)
class Document:
    input_ids: list[int]
    labels: list[int]        # same length; -100 where there is no loss


def _check(documents: Sequence[Document]) -> None:
    if not documents:
        raise ValueError("collate_packed got no documents; give at least one (a row of padding trains nothing)")
    for i, doc in enumerate(documents):
        if len(doc.input_ids) == 0:
            raise ValueError(f"document {i} is empty; drop empty documents before packing")
        if len(doc.labels) != len(doc.input_ids):
            raise ValueError(
                f"document {i} has {len(doc.input_ids)} input_ids but {len(doc.labels)} labels; "
                "give one label per token (-100 where there is no loss)"
            )


def collate_packed(documents: Sequence[Document], budget: int, pad_token_id: int) -> dict:
    """One row of `budget` tokens: the documents in order, then one masked dummy document."""
    _check(documents)
    lengths = [len(d.input_ids) for d in documents]
    total = sum(lengths)
    if total > budget:
        raise ValueError(
            f"documents hold {total} tokens but the row budget is {budget}; "
            "split them over more rows or raise the budget"
        )
    pad = budget - total
    if pad:
        lengths.append(pad)

    input_ids: list[int] = []
    labels: list[int] = []
    for doc in documents:
        input_ids.extend(doc.input_ids)
        # The first token of a document would be "predicted" from the previous document's last
        # token after the causal-LM shift: a cross-document loss term. Mask it.
        labels.append(IGNORE_INDEX)
        labels.extend(doc.labels[1:])
    input_ids.extend([pad_token_id] * pad)
    labels.extend([IGNORE_INDEX] * pad)

    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    max_length = max(lengths)
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.int64),
        "labels": torch.tensor([labels], dtype=torch.int64),
        "position_ids": position_ids[None],
        # Fresh tensors per call: fla caches index helpers by tensor identity, and a new tensor
        # keeps recompute under activation checkpointing on the same path as the forward.
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.clone(),
        "max_length_q": max_length,
        "max_length_k": max_length,
        "seq_idx": seq_idx[None],
    }


def collate_unpacked(document: Document) -> dict:
    """One document alone, batch of 1: the reference a packed row must reproduce."""
    _check([document])
    n = len(document.input_ids)
    labels = [IGNORE_INDEX] + list(document.labels[1:])
    return {
        "input_ids": torch.tensor([document.input_ids], dtype=torch.int64),
        "labels": torch.tensor([labels], dtype=torch.int64),
        "position_ids": torch.arange(n, dtype=torch.int64)[None],
    }
