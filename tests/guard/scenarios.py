"""Training runs the guard tests drive, each in a process where the guard was activated the way
the image does it (its .pth in site-packages). Run as a script under torchrun for two ranks, or
called in a forked child of tests/guard/forkserver.py (which already paid for the imports).

A spec is a dict:
  family:   the model family of the tiny model (default qwen3_5_text)
  trainer:  "trl" (TRL's SFTTrainer) | "loop" (a plain loop on contracts.collate rows) | "import"
            (import the modeling module only)
  kernels:  "none" | "fused" | "broken"   which test-double folder goes first on sys.path
  attention: "sdpa" | "fa2"                fa2: the flash_attn test double, registered as flash_attention_2
  batches:  "packed" (TRL's default BFD packing, padding-free) | "padded" | "position_ids"
            (DataCollatorWithFlattening with position_ids only); for "loop": "packed" | "padded"
  steps:    training steps
  sft_args: (trl) more SFTConfig arguments
  break_at: (loop) the step from which the boundaries are withheld
  eval_first: (loop) one no_grad forward of a packed row without seq_idx before training
  thread / checkpointing: (loop) train on a worker thread / with reentrant activation checkpointing
  default_cache: (loop) call the model without use_cache=False
  rebind:   (loop) names to rebind once the modeling module is imported, each to what it wraps
            underneath (inspect.unwrap): a module attribute ("causal_conv1d_fn": the torch reference)
            or a class attribute ("Qwen3_5GatedDeltaNet.forward": transformers' own forward)
  compile:  (loop) train `torch.compile(model, backend=...)`, e.g. "aot_eager"
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELS = {"fused": HERE / "kernels" / "fused", "broken": HERE / "kernels" / "broken"}


def put_kernels_first(kind: str) -> None:
    """Before the modeling module is imported: that is when transformers picks the kernels."""
    import importlib

    if kind == "broken":
        sys.path.insert(0, str(KERNELS["fused"]))      # fla and flash_attn work, causal_conv1d does not
    if kind in KERNELS:
        sys.path.insert(0, str(KERNELS[kind]))
    importlib.invalidate_caches()


def build(spec: dict, tokenizer=None):
    from families import load_family
    from families.runtime import build_model

    extra = {} if tokenizer is None else {"pad_token_id": tokenizer.pad_token_id,
                                          "eos_token_id": tokenizer.eos_token_id}
    model = build_model(load_family(spec.get("family", "qwen3_5_text")), "tiny", attn_implementation="sdpa", **extra)
    if spec.get("attention") == "fa2":
        import flash_attn  # the test double (kernels/fused/flash_attn)

        flash_attn.register()
        # transformers refuses flash_attention_2 without CUDA at init; the double runs on CPU
        model.config._attn_implementation = "flash_attention_2"
    return model


def run_trl(spec: dict, workdir: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorWithFlattening
    from trl import SFTConfig, SFTTrainer

    from tests.fixtures.chat import synthetic_conversations

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    model = build(spec, tokenizer)
    rows = [{"messages": r["messages"]} for r in synthetic_conversations(48, seed=1, max_turns=2)]
    batches = spec.get("batches", "packed")
    args = SFTConfig(output_dir=str(workdir / "out"), max_steps=spec.get("steps", 3), per_device_train_batch_size=4,
                     max_length=96, packing=batches == "packed", report_to=[], save_strategy="no", use_cpu=True,
                     logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0, bf16=False,
                     learning_rate=1e-3, **spec.get("sft_args", {}))
    collator = DataCollatorWithFlattening() if batches == "position_ids" else None
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         data_collator=collator)
    trainer.train()
    print("TRAINED", flush=True)


def run_loop(spec: dict, workdir: Path) -> None:
    import threading

    import torch

    from contracts.collate import Document, collate_packed, collate_unpacked
    from families.runtime import modeling_module

    model = build(spec).train()
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if spec.get("rebind"):
        rebind(spec["rebind"])
    forward = torch.compile(model, backend=spec["compile"]) if spec.get("compile") else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    docs = [Document(list(range(5, 45)), list(range(5, 45))), Document(list(range(7, 31)), list(range(7, 31)))]
    withhold = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")

    def row(step: int) -> dict:
        if spec.get("batches", "packed") == "padded":
            return collate_unpacked(docs[0])
        batch = collate_packed(docs, budget=80, pad_token_id=0)
        if spec.get("break_at") and step >= spec["break_at"]:
            for key in withhold:
                batch.pop(key)
        return batch

    if spec.get("eval_first"):
        with torch.no_grad():
            batch = collate_packed(docs, budget=80, pad_token_id=0)
            batch.pop("seq_idx")
            model(**batch, use_cache=False)

    def train() -> None:
        for step in range(1, spec.get("steps", 4) + 1):
            # use_cache=False as trainers pass it; left at the model's default, transformers builds a cache
            # and then skips its packed-sequence mask (masking_utils), so sdpa attends across documents
            extra = {} if spec.get("default_cache") else {"use_cache": False}
            loss = forward(**row(step), **extra).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"STEP {step} {loss.item():.4f}", flush=True)

    if spec.get("thread"):
        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
    else:
        train()
    import inspect

    from families import load_family

    # after the window the guard undoes its patches: the layer calls transformers' own wrapper again
    conv = modeling_module(load_family(spec.get("family", "qwen3_5_text"))).causal_conv1d_fn
    print(f"RESTORED {'implementation' in inspect.getclosurevars(conv).nonlocals}", flush=True)
    print("TRAINED", flush=True)


def rebind(names: list[str]) -> None:
    """What a trainer does to get round a check on the names a layer calls: bind each to what it
    wraps underneath, after the guard attached (the modeling module has been imported)."""
    import inspect

    from families import load_family
    from families.runtime import modeling_module

    module = modeling_module(load_family("qwen3_5_text"))
    for name in names:
        owner, _, attr = name.rpartition(".")
        target = getattr(module, owner) if owner else module
        setattr(target, attr, inspect.unwrap(getattr(target, attr)))
        print(f"REBOUND {name}", flush=True)


def run_import(spec: dict, workdir: Path) -> None:
    """Only import the modeling module: the guard activates (or says it is off) and nothing trains."""
    from families import load_family
    from families.runtime import modeling_module
    from guard import activate

    modeling_module(load_family("qwen3_5_text"))
    print(f"ACTIVE {activate.CURRENT is not None}", flush=True)


def run(spec: dict, workdir: Path) -> None:
    for key, value in spec.get("env", {}).items():
        os.environ[key] = value
    put_kernels_first(spec.get("kernels", "none"))
    trainers = {"trl": run_trl, "loop": run_loop, "import": run_import}
    trainers[spec.get("trainer", "trl")](spec, Path(workdir))


if __name__ == "__main__":      # under torchrun: scenarios.py SPEC_JSON WORKDIR
    sys.path.insert(0, str(HERE.parents[1]))
    run(json.loads(sys.argv[1]), Path(sys.argv[2]))
