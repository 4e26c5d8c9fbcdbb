"""Run under torchrun (2 ranks, gloo, CPU): our finetune's model path (entrypoint.model.sharded_model:
the family from the checkpoint's model_type, its FSDP units, its batch_adds) on a packed row of
documents, against the same documents one at a time. Prints one JSON line per rank.

    torchrun ... hybrid_loss_probe.py MODEL_DIR KERNELS_DIR
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[2])     # the kernel doubles first: transformers binds them at the modeling import
    import torch
    import torch.distributed as dist

    from contracts.collate import Document, collate_packed, collate_unpacked
    from entrypoint.loss import loss_sum
    from entrypoint.model import sharded_model

    dist.init_process_group("gloo")
    parallel = SimpleNamespace(activation_checkpoint="full", ac_every=1, dp_replicate=1, param_dtype="float32",
                               reduce_dtype="float32", reshard_after_forward=True)
    cfg = SimpleNamespace(parallel=parallel, model=SimpleNamespace(path=sys.argv[1], trust_remote_code=False))
    model, _ = sharded_model(cfg, attn="sdpa", device=torch.device("cpu"), world=dist.get_world_size())
    gen = torch.Generator().manual_seed(dist.get_rank())
    docs = [Document(ids, list(ids)) for ids in (torch.randint(3, 500, (n,), generator=gen).tolist()
                                                  for n in (37, 24, 45))]
    packed = collate_packed(docs, budget=112, pad_token_id=0)
    labels = packed.pop("labels")
    n_real = sum(len(d.input_ids) for d in docs)

    # what reached the Mamba2 kernels: the mixers look their functions up in the modeling module at
    # each call, so a recording shim there sees every call of a training step
    import transformers.models.falcon_h1.modeling_falcon_h1 as module
    calls = []
    for name in ("mamba2_split_conv1d_scan_combined", "mamba2_chunk_scan", "causal_conv1d_fn"):
        def shim(*args, _inner=getattr(module, name), _name=name, **kwargs):
            calls.append([_name, "seq_idx" in kwargs and kwargs["seq_idx"] is not None])
            return _inner(*args, **kwargs)
        setattr(module, name, shim)
    model.train()
    loss_sum(model, packed, labels).backward()      # a training step's forward and backward
    trained_calls = list(calls)
    with torch.no_grad():
        got = loss_sum(model, packed, labels).item()
        logits = model(**packed, use_cache=False).logits[0, :n_real]
        alone, alone_logits = [], []
        for doc in docs:
            single = collate_unpacked(doc)
            single_labels = single.pop("labels")
            alone.append(loss_sum(model, single, single_labels).item())
            alone_logits.append(model(**single, use_cache=False).logits[0])
        reference = torch.cat(alone_logits)
    print(json.dumps({"rank": dist.get_rank(), "packed": got, "alone": sum(alone),
                      "logits_rel": (logits - reference).abs().max().item() / reference.abs().max().item(),
                      "training_calls": trained_calls, "family": type(model).__name__}), flush=True)
    dist.destroy_process_group()
