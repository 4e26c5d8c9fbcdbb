"""Turn a bin of document ids into a model-ready micro-batch plus its accounting.

Packed bins go through `entrypoint.collate.collate_packed` (one [1, budget] row with
boundary signals). Padded bins become the 2D baseline here: [n, max_len], right-padded,
with an attention_mask. Right padding keeps every real token causal-before its pads, and
transformers zeroes padded states before the GDN conv (apply_mask_to_padding_states), so
the padded path is exact on every backend, which is why fallback runs use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from contracts.collate import IGNORE_INDEX, collate_packed
from entrypoint.data.tokenize import Corpus


@dataclass
class MicroBatch:
    inputs: dict              # kwargs for the model (labels excluded)
    labels: torch.Tensor      # [B, T], unshifted; -100 where no loss
    n_real: int               # real (non-pad) tokens
    area: int                 # token slots computed (B * T)
    doc_lengths: list[int]    # for the packing-aware attention FLOPs (sum of L_i^2)
    n_loss: int = -1          # tokens that carry loss; counted from the host copy of the labels

    def __post_init__(self):
        if self.n_loss < 0:
            self.n_loss = int(np.count_nonzero(self.labels.numpy()[:, 1:] != IGNORE_INDEX))


def build_micro_batch(corpus: Corpus, doc_ids: list[int], *, packed: bool, budget: int,
                      pad_token_id: int) -> MicroBatch:
    lengths = [int(corpus.lengths[i]) for i in doc_ids]
    if packed:
        batch = collate_packed([corpus.document(i) for i in doc_ids], budget, pad_token_id)
        labels = batch.pop("labels")
        return MicroBatch(inputs=batch, labels=labels, n_real=sum(lengths), area=budget, doc_lengths=lengths)
    return _collate_padded(corpus, doc_ids, lengths, pad_token_id)


def _collate_padded(corpus: Corpus, doc_ids: list[int], lengths: list[int], pad_token_id: int) -> MicroBatch:
    width = max(lengths)
    ids = np.full((len(doc_ids), width), pad_token_id, dtype=np.int64)
    labels = np.full((len(doc_ids), width), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(doc_ids), width), dtype=np.int64)
    for row, (i, n) in enumerate(zip(doc_ids, lengths)):
        ids[row, :n] = corpus.doc_tokens(i)
        labels[row, 1:n] = corpus.doc_labels(i)[1:]  # same first-token rule as collate_packed
        mask[row, :n] = 1
    return MicroBatch(
        inputs={"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)},
        labels=torch.from_numpy(labels), n_real=sum(lengths), area=len(doc_ids) * width, doc_lengths=lengths,
    )
