"""Measure how much packed documents leak into each other, per layer kind.

Three runs of the same tiny model on the same documents:
  * separate: each document alone (collate_unpacked), the reference;
  * packed: all documents in one row with position_ids, cu_seq_lens and seq_idx (collate_packed);
  * withheld: the same row with the boundary information withheld (negative control).

Per layer kind we teacher-force: each token mixer of the packed run is fed the concatenation of
the inputs it saw in the separate runs, and inside a mixer with a causal conv the conv output is
forced too. So each number is that kind's OWN leak, not leak inherited from earlier layers:
  * attention: the full-attention module's output;
  * conv:      causal_conv1d_fn's output (the conv leaks only the previous document's last
               width-1 tokens per boundary, so forcing is what makes it visible on its own);
  * gdn / kda / ssd: the mixer's output with its input and its conv output forced, so what is
               left is the recurrent core: the gated delta rule, Kimi delta attention, or the
               Mamba2 SSD chunk scan (the gated norm and projections after it act per token).
End to end (not forced): logits, and parameter gradients of the summed token loss.

The probe model runs in eval mode: a Mamba2 mixer in training with no cache calls the fused
split-conv1d-scan instead, whose conv cannot be observed on its own; the runtime guard watches
that path in training.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from contracts.collate import Document, collate_packed, collate_unpacked
from families import MEASURES, Family, with_batch_adds
from families import runtime as family_runtime
from verify.probe import BUDGET, DOC_LENGTHS, batch_to, sample_documents, token_loss_sum

KINDS = MEASURES        # attention, gdn, kda, conv, ssd
CORES = ("gdn", "kda", "ssd")   # measured on the mixer output, input and conv forced


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


Key = tuple[int, str]    # (decoder layer index, layer kind): Falcon-H1 holds two kinds per layer


class _Recorder:
    """Hooks that record (and optionally force) per-mixer tensors as (T, features)."""

    def __init__(self, model, module, family: Family, conv_wrapper: str | None):
        self.model, self.module, self.family, self.conv_wrapper = model, module, family, conv_wrapper
        self.mixer_in: dict[Key, torch.Tensor] = {}
        self.mixer_out: dict[Key, torch.Tensor] = {}
        self.conv_out: dict[Key, torch.Tensor] = {}
        self.force: dict[str, dict[Key, torch.Tensor]] | None = None  # "input"/"conv" -> key -> (T, F) teacher
        self.current: Key | None = None
        self.conv_kwargs: set[str] = set()

    def mixers(self):
        kinds = family_runtime.layer_kinds(self.family, self.model)
        for idx, layer in enumerate(family_runtime.decoder_layers(self.family, self.model)):
            for kind in kinds.get(idx, ()):
                mixer = family_runtime.mixer(self.family, layer, kind)
                if mixer is not None:
                    yield (idx, kind), mixer

    def _forced(self, what: str, key: Key, own: torch.Tensor) -> torch.Tensor:
        teacher = self.force[what][key]      # real-document tokens only; the dummy keeps its own values
        out = own.clone()
        out[: teacher.shape[0]] = teacher.to(own.dtype)
        return out

    @contextmanager
    def attached(self):
        handles = []
        original_conv = getattr(self.module, self.conv_wrapper) if self.conv_wrapper else None

        def pre(key):
            def hook(mod, args, kwargs):
                self.current = key
                # transformers 5.18 passes hidden_states by keyword; accept positional too
                positional = "hidden_states" not in kwargs
                hs = args[0] if positional else kwargs["hidden_states"]
                if self.force is not None:
                    hs = self._forced("input", key, hs[0])[None]
                    if positional:
                        args = (hs, *args[1:])
                    else:
                        kwargs = {**kwargs, "hidden_states": hs}
                self.mixer_in[key] = hs[0].detach()
                return args, kwargs
            return hook

        def post(key):
            def hook(mod, args, kwargs, output):
                out = output[0] if isinstance(output, tuple) else output
                self.mixer_out[key] = out[0].detach()
            return hook

        def conv_shim(*args, **kwargs):
            self.conv_kwargs.update(kwargs)
            out = original_conv(*args, **kwargs)      # (B, D, T)
            key = self.current
            self.conv_out[key] = out[0].transpose(0, 1).detach()
            if self.force is not None and key in self.force["conv"]:
                return self._forced("conv", key, out[0].transpose(0, 1)).transpose(0, 1)[None]
            return out

        for key, mixer in self.mixers():
            handles.append(mixer.register_forward_pre_hook(pre(key), with_kwargs=True))
            handles.append(mixer.register_forward_hook(post(key), with_kwargs=True))
        if self.conv_wrapper:
            setattr(self.module, self.conv_wrapper, conv_shim)
        try:
            yield self
        finally:
            if self.conv_wrapper:
                setattr(self.module, self.conv_wrapper, original_conv)
            for h in handles:
                h.remove()


def _concat(per_doc: list[dict[Key, torch.Tensor]]) -> dict[Key, torch.Tensor]:
    return {idx: torch.cat([d[idx] for d in per_doc]) for idx in per_doc[0]}


def max_diff(packed: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(absolute, relative) max difference of two same-shape tensors."""
    diff = (packed.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return diff, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _layers_diff(packed: dict[Key, torch.Tensor], reference: dict[Key, torch.Tensor], layers: list[Key],
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


def conv_wrapper_of(family: Family) -> str | None:
    """The modeling module's causal_conv1d_fn wrapper, when a layer kind measures its conv."""
    for kind in family.layer_kinds.values():
        if "conv" in kind.measure:
            for fused in kind.fused:
                if fused.function == "causal_conv1d_fn":
                    return fused.wrapper
    return None


def measured_keys(family: Family, model) -> dict[str, list[Key]]:
    """measure (attention, gdn, kda, conv, ssd) -> the (layer, kind) mixers it is read from."""
    found: dict[str, list[Key]] = {}
    for idx, kinds in family_runtime.layer_kinds(family, model).items():
        for kind in kinds:
            for what in family.layer_kinds[kind].measure:
                found.setdefault(what, []).append((idx, kind))
    return found


def measure(model, module, family: Family, *, device: str, lengths=DOC_LENGTHS, budget: int = BUDGET,
            seed: int = 0) -> Measurement:
    docs = sample_documents(lengths, model.config.vocab_size, seed=seed)
    n_real = sum(lengths)
    keys = measured_keys(family, model)
    rec = _Recorder(model, module, family, conv_wrapper_of(family))
    m = Measurement(layers={what: [idx for idx, _ in found] for what, found in keys.items()})
    # with what our trainer adds for the family (Kimi Linear's cu_seqlens): the probe measures the
    # boundaries a packed batch of ours carries
    packed_batch = with_batch_adds(family, collate_packed(docs, budget=budget, pad_token_id=0))

    with rec.attached():
        # 1. separate runs: reference activations, logits and summed gradients
        model.zero_grad(set_to_none=True)
        sep = {"input": [], "out": [], "conv": [], "logits": []}
        for doc in docs:
            single = collate_unpacked(doc)
            logits = _run(model, single, device)
            token_loss_sum(logits, single["labels"].to(device)).backward()
            for key, src in (("input", rec.mixer_in), ("out", rec.mixer_out), ("conv", rec.conv_out)):
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
                    for what, found in keys.items():
                        got, want = (rec.conv_out, ref["conv"]) if what == "conv" else (rec.mixer_out, ref["out"])
                        absolute[what], rel[what] = _layers_diff(got, want, found, n_real)
            finally:
                rec.force = None
    return m
