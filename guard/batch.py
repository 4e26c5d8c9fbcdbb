"""What one batch says about packing, read at the family model's forward (host syncs allowed: the
guard only reads batches inside its checking window).

A batch is packed when a row holds more than one document. That shows as position_ids that
restart inside a row (the criterion transformers' own packed-mask detection uses,
masking_utils.find_packed_sequence_indices: a step other than +1), or as cu_seq_lens_q / seq_idx
with more than one document. Qwen3.5 may get 3-D MRoPE position_ids: (4, B, T) carries the text
positions in row 0 (what transformers uses); (3, B, T) is temporal/height/width, where height and
width restart inside every image, so only a temporal step back, or all three rows back at 0, is
read as a new document (transformers PR #44911: misread 3-D ids crashed flash-attn).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# keyword arguments that carry document boundaries (or padding) down the model's **kwargs
BOUNDARY_KWARGS = ("position_ids", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                   "max_length_k", "seq_idx")
MASK_CHUNK = 1024   # query rows per block when checking a (B, 1, T, T) mask against the documents


@dataclass
class Batch:
    training: bool
    packed: bool | None = None          # None: unknown (a call outside the family's model classes)
    docs: torch.Tensor | None = None    # (B, T) document index of every token, when packed
    documents: int = 0                  # documents in the batch (all rows)
    layout: str = "none"                # position_ids: "2d", "mrope4", "mrope3", "none"
    position_packed: bool = False       # the position_ids themselves restart inside a row
    kwargs_seen: tuple[str, ...] = ()   # BOUNDARY_KWARGS that arrived (not None)
    rows: int = 0
    tokens: int = 0
    notes: list[str] = field(default_factory=list)


def _starts_2d(pos: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: token t starts a document (t == 0, or its position is not the previous + 1)."""
    starts = torch.ones_like(pos, dtype=torch.bool)
    if pos.shape[-1] > 1:
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return starts


def _starts_mrope3(pos: torch.Tensor) -> torch.Tensor:
    starts = torch.ones(pos.shape[1:], dtype=torch.bool, device=pos.device)
    if pos.shape[-1] > 1:
        temporal = pos[0]
        starts[:, 1:] = (temporal[:, 1:] < temporal[:, :-1]) | (pos[:, :, 1:] == 0).all(0)
    return starts


def position_starts(position_ids, attention_mask=None) -> tuple[torch.Tensor | None, str]:
    """Document starts from position_ids (None when they say nothing), and their layout. Tokens
    the 2-D attention_mask pads out never start a document (left padding has positions 1, 1, 0...)."""
    if not torch.is_tensor(position_ids):
        return None, "none"
    pos = position_ids.detach()
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() == 2:
        layout = "2d"
    elif pos.dim() == 3 and pos.shape[0] == 4:
        pos, layout = pos[0], "mrope4"
    elif pos.dim() == 3 and pos.shape[0] == 3:
        layout = "mrope3"
    else:
        return None, f"position_ids of shape {tuple(pos.shape)}"
    if attention_mask is not None and torch.is_tensor(attention_mask) and attention_mask.dim() == 2 \
            and attention_mask.shape == pos.shape[-2:]:
        keep = attention_mask.detach().bool()
        if not keep.all():
            return _starts_masked(pos, keep, layout), layout
    starts = _starts_mrope3(pos) if layout == "mrope3" else _starts_2d(pos)
    return starts, layout


def _starts_masked(pos: torch.Tensor, keep: torch.Tensor, layout: str) -> torch.Tensor:
    """Starts read over each row's real tokens only. Padding never starts a document: left padding
    joins the row's first document, any other padding the document before it."""
    rows = []
    for b in range(keep.shape[0]):
        idx = keep[b].nonzero().flatten()
        row = torch.zeros(keep.shape[1], dtype=torch.bool, device=keep.device)
        if idx.numel():
            real = pos[:, b, idx][:, None] if layout == "mrope3" else pos[b, idx][None]
            row[idx] = (_starts_mrope3(real) if layout == "mrope3" else _starts_2d(real))[0]
            row[idx[0]] = False
        row[0] = True
        rows.append(row)
    return torch.stack(rows)


def docs_from_cu_seqlens(cu: torch.Tensor, tokens: int) -> torch.Tensor | None:
    cu = cu.detach().flatten().long()
    if cu.numel() < 2 or int(cu[-1]) != tokens or bool((cu.diff() < 0).any()):
        return None
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu.diff())[None]


def _docs_from_starts(starts: torch.Tensor) -> torch.Tensor:
    return starts.long().cumsum(-1) - 1


def _count(docs: torch.Tensor) -> int:
    return int(sum(int(row.unique().numel()) for row in docs))


def inspect_batch(arguments: dict, training: bool) -> Batch:
    """Read a batch from the bound arguments of the family model's forward."""
    seen = tuple(k for k in BOUNDARY_KWARGS if arguments.get(k) is not None)
    batch = Batch(training=training, packed=False, kwargs_seen=seen)
    ids = arguments.get("input_ids")
    embeds = arguments.get("inputs_embeds")
    shape = ids.shape if torch.is_tensor(ids) else embeds.shape[:2] if torch.is_tensor(embeds) else None
    if shape is not None and len(shape) == 2:
        batch.rows, batch.tokens = int(shape[0]), int(shape[1])
    mask = arguments.get("attention_mask")
    starts, batch.layout = position_starts(arguments.get("position_ids"), mask if torch.is_tensor(mask) else None)
    if batch.layout.startswith("position_ids of shape"):
        batch.notes.append(f"{batch.layout} not read")
    candidates = []
    if starts is not None:
        docs = _docs_from_starts(starts)
        batch.position_packed = bool((docs[:, -1] > 0).any()) if docs.numel() else False
        candidates.append(docs)
    cu = arguments.get("cu_seq_lens_q")
    if torch.is_tensor(cu) and batch.rows == 1:
        docs = docs_from_cu_seqlens(cu, batch.tokens)
        if docs is not None:
            candidates.append(docs)
    seq_idx = arguments.get("seq_idx")
    if torch.is_tensor(seq_idx) and seq_idx.dim() == 2 and seq_idx.shape[-1] == batch.tokens and seq_idx.numel():
        s = seq_idx.detach()
        changes = torch.ones_like(s, dtype=torch.bool)
        changes[:, 1:] = s[:, 1:] != s[:, :-1]
        candidates.append(_docs_from_starts(changes))
    for docs in candidates:
        if docs.numel() and bool((docs[:, -1] > 0).any()):
            batch.packed, batch.docs, batch.documents = True, docs, _count(docs)
            break
    return batch


def mask_separates(mask, docs: torch.Tensor | None) -> tuple[bool | None, str]:
    """Does the mask a torch attention got keep every query inside its own document?
    (True, ""), (False, why), or (None, why) when it cannot be read."""
    if docs is None:
        return None, "the documents of this batch are not known"
    if mask is None:
        return False, "it got no attention mask, so each token attends to every earlier token of the row"
    if not torch.is_tensor(mask):
        return None, f"its mask is a {type(mask).__name__}, which the guard cannot read"
    m = mask.detach()
    if m.dim() == 2:
        return False, "its mask is a 2-D padding mask, which does not separate documents"
    if m.dim() != 4 or m.shape[-1] != docs.shape[-1] or m.shape[-2] != docs.shape[-1]:
        return None, f"its mask has shape {tuple(m.shape)}, not (B, H, T, T) for T={docs.shape[-1]}"
    allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    allowed = allowed.any(1)                              # over heads: any head attending counts
    if allowed.shape[0] != docs.shape[0]:
        allowed = allowed.expand(docs.shape[0], -1, -1)
    docs = docs.to(allowed.device)
    for q0 in range(0, docs.shape[-1], MASK_CHUNK):
        q1 = min(q0 + MASK_CHUNK, docs.shape[-1])
        cross = docs[:, q0:q1, None] != docs[:, None, :]
        if bool((allowed[:, q0:q1] & cross).any()):
            return False, "its mask lets tokens attend across document boundaries"
    return True, ""
