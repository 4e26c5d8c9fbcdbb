"""TRL's SFTTrainer with packing on chat data, as a team would run it on this project's image
(images/qwen27b-trl), behind the gate and under the runtime guard:

    ftimage-gate --model /models/base -- torchrun --nproc-per-node 8 sft_packed.py \
        --model /models/base --data /data/train.jsonl --output /out/sft
    ftimage-gate --model /models/base -- accelerate launch --config_file fsdp2.yaml sft_packed.py ...

What makes packed training right with Qwen3.5 hybrids, and what the guard checks at step 1:
BFD packing with padding_free collation (TRL's default with packing) hands every layer its
document boundaries (`cu_seq_lens_q/k` for flash attention, the same for the gated delta rule,
`seq_idx` for the causal conv1d), and attention must be flash_attention_2: sdpa and eager
attend across the packed documents.
"""
from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local HF model folder (config.json, safetensors, tokenizer)")
    p.add_argument("--data", required=True, help="chat rows as JSON lines with a `messages` list")
    p.add_argument("--output", required=True)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--max-length", type=int, default=8192, help="tokens per packed row")
    p.add_argument("--batch-size", type=int, default=1, help="packed rows per device")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--attn", default="flash_attention_2",
                   help="flash_attention_2 on a GPU; anything else attends across packed documents")
    p.add_argument("--cpu", action="store_true", help="no GPU (a smoke run of the script itself)")
    args = p.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn, dtype=dtype)
    config = SFTConfig(
        output_dir=args.output, max_steps=args.max_steps, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size, max_length=args.max_length,
        packing=True,                 # BFD packing: whole documents, boundaries kept ...
        padding_free=True,            # ... and passed down as cu_seq_lens and seq_idx
        assistant_only_loss=False, bf16=not args.cpu, use_cpu=args.cpu, logging_steps=10,
        save_strategy="steps", save_steps=500, report_to=[], gradient_checkpointing=not args.cpu)
    rows = load_dataset("json", data_files=args.data, split="train").select_columns(["messages"])
    SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer).train()


if __name__ == "__main__":
    main()
