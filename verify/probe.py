"""verify's probe: a small model of the image's family, packed documents, and the one watched
step (which Python code ran, which GPU kernels ran) that dispatch, fused_ops and the GPU
benchmark all use.

The probe model is the family's `probe` flavour: tiny, but attention runs at the head dim
the image compiled (build/ specialises flash-attn to the family's head dims).
"""
from __future__ import annotations

from types import CodeType

import torch
import torch.nn.functional as F

from contracts.collate import Document, collate_packed
from families import runtime
from verify.calltrace import innermost_code
from verify.context import Context

# 3 documents, so there are two real boundaries, plus a padding document; lengths are not
# multiples of fla's 64-token chunk, so a boundary falls inside a chunk, and odd for the conv.
DOC_LENGTHS = (40, 24, 33)
BUDGET = 112


def sample_documents(lengths, vocab_size: int, seed: int = 0) -> list[Document]:
    """Random token documents (labels = input_ids); deterministic per seed."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(1, vocab_size, (n,), generator=gen).tolist()
        docs.append(Document(input_ids=ids, labels=list(ids)))
    return docs


def batch_to(batch: dict, device: str) -> dict:
    """Move tensors to `device`; python ints (max_length_q/k) stay as they are."""
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def packed_batch(vocab_size: int, device: str, lengths=DOC_LENGTHS, budget: int = BUDGET, seed: int = 0) -> dict:
    return batch_to(collate_packed(sample_documents(lengths, vocab_size, seed=seed), budget=budget, pad_token_id=0),
                    device)


def token_loss_sum(logits, labels):
    """Summed next-token loss; a sum (not a mean) so per-document losses add up to the packed one."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def build_probe_model(ctx: Context, *, attn_implementation: str, dtype=None):
    return runtime.build_model(ctx.family, "probe", attn_implementation=attn_implementation, device=ctx.device,
                               dtype=dtype if dtype is not None else runtime.probe_dtype(ctx.device),
                               head_dim=ctx.probe_head_dim)


def watched_code(ctx: Context, module, resolutions: dict) -> dict[str, CodeType | None]:
    """label -> the code object whose calls are counted: per fused function its torch
    reference ("<fn>:torch") and the fused implementation ("<fn>:fused"), and the attention
    paths (torch sdpa/eager vs flash)."""
    # transformers only here: op_numerics imports this module for its documents, which need none
    from transformers.integrations import flash_attention, sdpa_attention

    watched: dict[str, CodeType | None] = {}
    for need in ctx.needs():
        res = resolutions[need.function]
        watched[f"{need.function}:torch"] = innermost_code(res.torch_function) if res.torch_function else None
        watched[f"{need.function}:fused"] = innermost_code(res.implementation) if res.is_new else None
    watched["attention:torch_sdpa"] = innermost_code(sdpa_attention.sdpa_attention_forward)
    watched["attention:torch_eager"] = innermost_code(module.eager_attention_forward)
    watched["attention:fused"] = innermost_code(flash_attention.flash_attention_forward)
    return watched
