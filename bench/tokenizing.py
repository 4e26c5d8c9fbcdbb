"""Tokenising through `datasets` (Dataset.map, num_proc) vs the in-process row reader, side by side.

    python bench/tokenizing.py [--rows 50000] [--num-proc 2]

Both paths run the same reading, schema, chat-template rendering and masking code on the same
ultrachat-shaped rows and the same tokenizer (built here, offline); only the driver differs:
  reader    read_rows + tokenize_rows in this process (what training used before datasets)
  datasets  load_corpus: Dataset.from_generator + Dataset.map(num_proc) into memory-mapped Arrow
Prints rows/s of each and the ratio. Target: datasets >= the reader with num_proc=2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50000)
    ap.add_argument("--num-proc", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from contracts.finetune_config import build_config
    from entrypoint.data.corpus_build import load_corpus
    from entrypoint.data.rows import read_rows
    from entrypoint.data.tokenize import tokenize_rows
    from tests.fixtures.chat import synthetic_conversations, write_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        root = Path(tmp)
        rows = synthetic_conversations(args.rows, seed=0, max_turns=4)
        write_tokenizer(root / "tok", [m["content"] for r in rows[:2000] for m in r["messages"]])
        tokenizer = AutoTokenizer.from_pretrained(str(root / "tok"))   # a tokenizer folder, no model
        data = root / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        size = data.stat().st_size

        t0 = time.perf_counter()
        reader = tokenize_rows(read_rows(str(data)), tokenizer, max_length=8192)
        reader_s = time.perf_counter() - t0

        cfg = build_config([{"model": {"path": "m"}, "data": {"path": str(data), "num_proc": args.num_proc}}])
        t0 = time.perf_counter()
        mapped = load_corpus(cfg, tokenizer, cache_dir=root / "cache")
        datasets_s = time.perf_counter() - t0
        assert len(mapped) == len(reader) and mapped.n_tokens == reader.n_tokens, "the two paths disagree"

    print(f"{args.rows} rows ({size / 2 ** 20:.1f} MiB), {reader.n_tokens:,} tokens, {os.cpu_count()} cores")
    print(f"reader    {reader_s:7.2f} s  {args.rows / reader_s:9.0f} rows/s  (one process)")
    print(f"datasets  {datasets_s:7.2f} s  {args.rows / datasets_s:9.0f} rows/s  (num_proc={args.num_proc}, "
          "Arrow on disk, memory-mapped)")
    ratio = reader_s / datasets_s
    print(f"speed-up datasets/reader: {ratio:.2f}x; target >= 1.0: {'PASS' if ratio >= 1.0 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
