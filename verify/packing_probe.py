"""Measure how much packed documents leak into each other, per layer kind.

Three runs of the same tiny model on the same documents:
  * separate: each document alone (collate_unpacked), the reference;
  * packed: all documents in one row with position_ids, cu_seq_lens and seq_idx (collate_packed);
  * withheld: the same row with the boundary information withheld (negative control).

Per layer kind we teacher-force: each token mixer (attention / GDN) of the packed run is fed the
concatenation of the inputs it saw in the separate runs, and inside GDN the conv output is forced
too. So each kind's number is its OWN leak, not leak inherited from earlier layers:
  * attention: the full-attention module's output;
  * conv:      causal_conv1d_fn's output (the conv leaks only the previous document's last
               width-1 = 3 tokens per boundary, so forcing is what makes it visible on its own);
  * gdn:       the delta-rule core output (input to the gated norm), with the conv output forced.
End to end (not forced): logits, and parameter gradients of the summed token loss.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from contracts.collate import Document, collate_packed, collate_unpacked
from families import Family
from families import runtime as family_runtime
from verify.probe import BUDGET, DOC_LENGTHS, batch_to, sample_documents, token_loss_sum

KINDS = ("attention", "gdn", "conv")


@dataclass
class Measurement:
    """Differences vs the separate runs, over real-document tokens only.

    Relative = max |packed - separate| / max |separate|, so one tolerance fits fp32 on CPU and
    bf16 on GPU whatever the tiny model's activation scale; the absolute numbers are kept too.
    """

    packed: dict[str, float] = field(default_factory=dict)     # kind -> relative diff, boundaries given
    withheld: dict[str, float] = field(default_factory=dict)   # kind -> relative diff, boundaries withheld
    packed_abs: dict[str, float] = field(default_factory=dict)
    withheld_abs: dict[str, float] = field(default_factory=dict)
    logits: float = 0.0               # relative
    logits_withheld: float = 0.0      # relative
    logits_abs: float = 0.0
    logits_withheld_abs: float = 0.0
    grads_rel: float = 0.0            # max |g_packed - g_sep| / max |g_sep| over all parameters
    grads_worst_param: str = ""
    conv_kwargs_seen: tuple[str, ...] = ()   # kwargs that reached the causal_conv1d_fn wrapper
    layers: dict[str, list[int]] = field(default_factory=dict)


def _spans(documents: list[Document]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for doc in documents:
        spans.append((start, start + len(doc.input_ids)))
        start += len(doc.input_ids)
    return spans


def withhold_boundaries(batch: dict) -> dict:
    """Negative control: same tokens, but no position restart, no cu_seq_lens, no seq_idx."""
    n = batch["input_ids"].shape[1]
    return {"input_ids": batch["input_ids"], "labels": batch["labels"],
            "position_ids": torch.arange(n, device=batch["input_ids"].device)[None]}


class _Recorder:
    """Hooks that record (and optionally force) per-layer tensors as (T, features)."""

    def __init__(self, model, module, family: Family, conv_wrapper: str):
        self.model, self.module, self.family, self.conv_wrapper = model, module, family, conv_wrapper
        self.mixer_in: dict[int, torch.Tensor] = {}
        self.mixer_out: dict[int, torch.Tensor] = {}
        self.conv_out: dict[int, torch.Tensor] = {}
        self.core_out: dict[int, torch.Tensor] = {}
        self.force: dict[str, dict[int, torch.Tensor]] | None = None  # kind -> layer -> (T, F) teacher
        self.current_layer = -1
        self.conv_kwargs: set[str] = set()

    def mixers(self):
        kinds = family_runtime.layer_kinds(self.model)
        for idx, layer in enumerate(family_runtime.decoder_layers(self.family, self.model)):
            kind = kinds[idx]
            yield idx, family_runtime.mixer(self.family, layer, kind), "conv" in self.family.layer_kinds[kind].measure

    def _forced(self, kind: str, idx: int, own: torch.Tensor) -> torch.Tensor:
        teacher = self.force[kind][idx]      # real-document tokens only; the dummy keeps its own values
        out = own.clone()
        out[: teacher.shape[0]] = teacher.to(own.dtype)
        return out

    @contextmanager
    def attached(self):
        handles = []
        original_conv = getattr(self.module, self.conv_wrapper)

        def pre(idx):
            def hook(mod, args, kwargs):
                self.current_layer = idx
                # transformers 5.18 passes hidden_states by keyword; accept positional too
                positional = "hidden_states" not in kwargs
                hs = args[0] if positional else kwargs["hidden_states"]
                if self.force is not None:
                    hs = self._forced("input", idx, hs[0])[None]
                    if positional:
                        args = (hs, *args[1:])
                    else:
                        kwargs = {**kwargs, "hidden_states": hs}
                self.mixer_in[idx] = hs[0].detach()
                return args, kwargs
            return hook

        def post(idx):
            def hook(mod, args, kwargs, output):
                out = output[0] if isinstance(output, tuple) else output
                self.mixer_out[idx] = out[0].detach()
            return hook

        def core(idx, n_tokens_of):
            def hook(mod, args):
                self.core_out[idx] = args[0].detach().reshape(n_tokens_of(), -1)
            return hook

        def conv_shim(*args, **kwargs):
            self.conv_kwargs.update(kwargs)
            out = original_conv(*args, **kwargs)      # (B, D, T)
            idx = self.current_layer
            self.conv_out[idx] = out[0].transpose(0, 1).detach()
            if self.force is not None:
                return self._forced("conv", idx, out[0].transpose(0, 1)).transpose(0, 1)[None]
            return out

        for idx, mixer, is_gdn in self.mixers():
            handles.append(mixer.register_forward_pre_hook(pre(idx), with_kwargs=True))
            handles.append(mixer.register_forward_hook(post(idx), with_kwargs=True))
            if is_gdn:
                handles.append(mixer.norm.register_forward_pre_hook(
                    core(idx, lambda i=idx: self.mixer_in[i].shape[0])))
        setattr(self.module, self.conv_wrapper, conv_shim)
        try:
            yield self
        finally:
            setattr(self.module, self.conv_wrapper, original_conv)
            for h in handles:
                h.remove()


def _concat(per_doc: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    return {idx: torch.cat([d[idx] for d in per_doc]) for idx in per_doc[0]}


def max_diff(packed: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(absolute, relative) max difference of two same-shape tensors."""
    diff = (packed.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return diff, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _layers_diff(packed: dict[int, torch.Tensor], reference: dict[int, torch.Tensor], layers: list[int],
                 n_real: int) -> tuple[float, float]:
    pairs = [(packed[i][:n_real], reference[i]) for i in layers if i in packed]
    if not pairs:
        return float("nan"), float("nan")
    return max_diff(torch.cat([p.reshape(-1) for p, _ in pairs]), torch.cat([r.reshape(-1) for _, r in pairs]))


def _run(model, batch, device):
    inputs = batch_to({k: v for k, v in batch.items() if k != "labels"}, device)
    # use_cache=False as in training. With the default cache, transformers skips its packed-sequence
    # mask detection (masking_utils.find_packed_sequence_indices) and sdpa attends across documents.
    return model(**inputs, use_cache=False).logits


def measure(model, module, family: Family, *, device: str, conv_wrapper: str = "causal_conv1d_fn",
            lengths=DOC_LENGTHS, budget: int = BUDGET, seed: int = 0) -> Measurement:
    docs = sample_documents(lengths, model.config.vocab_size, seed=seed)
    n_real = sum(lengths)
    kinds = family_runtime.layer_kinds(model)
    attn_layers = [i for i, k in kinds.items() if "attention" in family.layer_kinds[k].measure]
    gdn_layers = [i for i, k in kinds.items() if "gdn" in family.layer_kinds[k].measure]
    rec = _Recorder(model, module, family, conv_wrapper)
    m = Measurement(layers={"attention": attn_layers, "gdn": gdn_layers, "conv": gdn_layers})
    packed_batch = collate_packed(docs, budget=budget, pad_token_id=0)

    with rec.attached():
        # 1. separate runs: reference activations, logits and summed gradients
        model.zero_grad(set_to_none=True)
        sep = {"input": [], "out": [], "conv": [], "core": [], "logits": []}
        for doc in docs:
            single = collate_unpacked(doc)
            logits = _run(model, single, device)
            token_loss_sum(logits, single["labels"].to(device)).backward()
            for key, src in (("input", rec.mixer_in), ("out", rec.mixer_out), ("conv", rec.conv_out),
                             ("core", rec.core_out)):
                sep[key].append(dict(src))
            sep["logits"].append(logits[0].detach())
        ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        ref = {k: _concat(v) for k, v in sep.items() if k != "logits"}
        ref_logits = torch.cat(sep["logits"])

        # 2. packed, end to end: logits and gradients
        model.zero_grad(set_to_none=True)
        rec.conv_kwargs.clear()
        logits = _run(model, packed_batch, device)
        token_loss_sum(logits, packed_batch["labels"].to(device)).backward()
        m.conv_kwargs_seen = tuple(sorted(rec.conv_kwargs))
        m.logits_abs, m.logits = max_diff(logits[0, :n_real].detach(), ref_logits)
        scale = max(g.abs().max().item() for g in ref_grads.values()) or 1.0
        worst = ("", 0.0)
        for name, p in model.named_parameters():
            if name in ref_grads:
                d = (p.grad - ref_grads[name]).abs().max().item() / scale
                worst = max(worst, (name, d), key=lambda t: t[1])
        m.grads_worst_param, m.grads_rel = worst
        model.zero_grad(set_to_none=True)

        with torch.no_grad():
            # 3. withheld, end to end (negative control)
            logits_w = _run(model, withhold_boundaries(packed_batch), device)
            m.logits_withheld_abs, m.logits_withheld = max_diff(logits_w[0, :n_real], ref_logits)

            # 4. per kind, teacher-forced, with and without boundaries
            rec.force = {"input": ref["input"], "conv": ref["conv"]}
            try:
                for label, batch in (("packed", packed_batch), ("withheld", withhold_boundaries(packed_batch))):
                    _run(model, batch, device)
                    rel, absolute = (m.packed, m.packed_abs) if label == "packed" else (m.withheld, m.withheld_abs)
                    for kind, got, want, layers in (("attention", rec.mixer_out, ref["out"], attn_layers),
                                                    ("conv", rec.conv_out, ref["conv"], gdn_layers),
                                                    ("gdn", rec.core_out, ref["core"], gdn_layers)):
                        absolute[kind], rel[kind] = _layers_diff(got, want, layers, n_real)
            finally:
                rec.force = None
    return m
