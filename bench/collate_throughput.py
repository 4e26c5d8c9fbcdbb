"""Pack-and-collate throughput on one CPU core: the data side of every training step.

    python bench/collate_throughput.py [--docs 20000] [--budget 8192] [--mode packed|padded|both]

Runs what the trainer runs per micro-batch: the sampler's BFD stream (entrypoint/data/sampler.py)
and entrypoint.data.micro_batches.build_micro_batch (collate_packed for packed rows), over a
synthetic corpus with ultrachat-like lengths (bench/packing_efficiency.py). Reports real tokens/s.
Target: >= 2M tokens/s on one core, so data never stalls a GPU step (an 8192-token row
on an H200 takes ~10 ms of compute at 27B-class sizes; 2M tok/s = 4 ms per row).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.packing_efficiency import synthetic_ultrachat  # noqa: E402
from entrypoint.data.micro_batches import build_micro_batch  # noqa: E402
from entrypoint.data.sampler import PackedSampler  # noqa: E402
from entrypoint.data.tokenize import IGNORE, BadRows, Corpus  # noqa: E402


def synthetic_corpus(n_docs: int, budget: int, seed: int) -> Corpus:
    lengths = np.minimum(synthetic_ultrachat(n_docs, 4.0, 0.55, seed), budget)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 150_000, size=int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(len(tokens)) < 0.6, tokens, IGNORE).astype(np.int32)
    return Corpus.from_arrays(tokens, labels, offsets, np.arange(n_docs), BadRows(), n_docs)


def run(corpus: Corpus, mode: str, budget: int, window: int) -> dict:
    packed = mode == "packed"
    sampler = PackedSampler(corpus.lengths, "bfd" if packed else "padded", budget, window, seed=0)
    t0 = time.perf_counter()
    sampler.item(0)  # packing the epoch is part of the cost; time it separately
    pack_s = time.perf_counter() - t0
    n_batches = len(sampler.epoch_bins(0))
    real = 0
    t1 = time.perf_counter()
    for _ in range(n_batches):
        _, (ids,) = sampler.next_step()
        mb = build_micro_batch(corpus, ids, packed=packed, budget=budget, pad_token_id=0)
        real += mb.n_real
    collate_s = time.perf_counter() - t1
    return {"mode": mode, "batches": n_batches, "tokens": real, "pack_s": pack_s, "collate_s": collate_s,
            "tokens_per_s": real / (pack_s + collate_s)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--window", type=int, default=10000)
    ap.add_argument("--mode", choices=["packed", "padded", "both"], default="both")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, honestly
    except (AttributeError, OSError):
        pass
    corpus = synthetic_corpus(args.docs, args.budget, seed=0)
    print(f"corpus: {len(corpus):,} docs, {corpus.n_tokens:,} tokens; budget {args.budget}; 1 core")
    modes = ["packed", "padded"] if args.mode == "both" else [args.mode]
    results = [run(corpus, m, args.budget, args.window) for m in modes]
    for r in results:
        print(f"{r['mode']:<7} {r['batches']:>6} batches  pack {r['pack_s']:.2f}s  collate {r['collate_s']:.2f}s  "
              f"{r['tokens_per_s'] / 1e6:.2f}M real tokens/s")
    packed = results[0]
    ok = packed["mode"] != "packed" or packed["tokens_per_s"] >= 2e6
    print(f"target packed >= 2M tokens/s on one core: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
