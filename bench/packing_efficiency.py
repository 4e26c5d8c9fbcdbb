"""Batch count and padding of three batching schemes at a token budget, side by side.

    python bench/packing_efficiency.py --synthetic ultrachat [--budget 8192] [--window 10000]
    python bench/packing_efficiency.py --lengths FILE     # one token count per line (or .npy)

Schemes (the code training uses, entrypoint/data/packing.py, in the same shuffled order):
  padded  2D padded batches in random order: the recipe's baseline
  greedy  1D next-fit in random order
  bfd     1D best-fit-decreasing within a shuffle window (what finetune uses)
against the lower bound ceil(total_tokens / budget). Targets: bfd within 1% of the bound,
and bfd at most 0.60x the padded batch count.

Synthetic ultrachat lengths. Published figures (dataset card,
https://huggingface.co/datasets/HuggingFaceH4/ultrachat_200k): train_sft holds 207,865
conversations, about 1.4 GB of text, i.e. ~6.7 kB per conversation. At ~4 characters per
token (English BPE; --chars-per-token) that is a mean of ~1,680 tokens per rendered
conversation. The shape is ASSUMED lognormal with sigma 0.55 (--sigma): multi-turn chats
of a few turns each, right-skewed, few beyond 8k. Rows over the budget are truncated to
it, as data.overlong=truncate does. Use --lengths with real tokenized lengths when you
have them; the synthetic model only fixes the scale.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entrypoint.data.packing import batch_area, lower_bound, pack_windows  # noqa: E402

ULTRACHAT_TRAIN_SFT_ROWS = 207_865
ULTRACHAT_TEXT_BYTES = 1.4e9


def synthetic_ultrachat(n: int, chars_per_token: float, sigma: float, seed: int) -> np.ndarray:
    mean_tokens = ULTRACHAT_TEXT_BYTES / ULTRACHAT_TRAIN_SFT_ROWS / chars_per_token
    mu = math.log(mean_tokens) - sigma ** 2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    return np.maximum(1, np.random.default_rng(seed).lognormal(mu, sigma, n).round()).astype(np.int64)


def read_lengths(path: str) -> np.ndarray:
    p = Path(path)
    if p.suffix == ".npy":
        return np.load(p).astype(np.int64)
    return np.array([int(x) for x in p.read_text().split()], dtype=np.int64)


def measure(lengths: np.ndarray, budget: int, window: int, seed: int) -> list[dict]:
    order = np.random.default_rng(seed).permutation(len(lengths))
    rows = []
    for scheme in ("padded", "greedy", "bfd"):
        t = time.perf_counter()
        bins = pack_windows(lengths, order, scheme, budget, window if scheme == "bfd" else len(lengths))
        seconds = time.perf_counter() - t
        area = sum(batch_area(lengths[b].tolist(), scheme, budget) for b in map(np.asarray, bins))
        rows.append({"scheme": scheme, "batches": len(bins), "padding": 1 - lengths.sum() / area,
                     "seconds": seconds})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="file of token counts (whitespace separated, or .npy)")
    src.add_argument("--synthetic", choices=["ultrachat"])
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--window", type=int, default=10000, help="BFD shuffle window (documents)")
    ap.add_argument("--rows", type=int, default=ULTRACHAT_TRAIN_SFT_ROWS)
    ap.add_argument("--chars-per-token", type=float, default=4.0)
    ap.add_argument("--sigma", type=float, default=0.55)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    lengths = read_lengths(args.lengths) if args.lengths else \
        synthetic_ultrachat(args.rows, args.chars_per_token, args.sigma, args.seed)
    truncated = int((lengths > args.budget).sum())
    lengths = np.minimum(lengths, args.budget)
    bound = lower_bound(lengths, args.budget)
    print(f"documents {len(lengths):,}  tokens {int(lengths.sum()):,}  mean {lengths.mean():.0f}  "
          f"p50 {np.median(lengths):.0f}  p99 {np.percentile(lengths, 99):.0f}  max {lengths.max()}  "
          f"truncated to budget {truncated}")
    print(f"budget {args.budget}  BFD window {args.window}  lower bound ceil(total/budget) = {bound:,}\n")
    rows = measure(lengths, args.budget, args.window, args.seed)
    padded = rows[0]["batches"]
    print(f"{'scheme':<8} {'batches':>9} {'vs bound':>9} {'vs padded':>10} {'padding':>8} {'pack time':>10}")
    for r in rows:
        print(f"{r['scheme']:<8} {r['batches']:>9,} {r['batches'] / bound:>9.4f} {r['batches'] / padded:>10.3f} "
              f"{r['padding']:>8.1%} {r['seconds']:>9.2f}s")
    bfd = rows[-1]["batches"]
    ok_bound = bfd <= bound * 1.01
    ok_ratio = bfd <= 0.60 * padded
    print(f"\ntarget bfd <= 1.01 x bound: {'PASS' if ok_bound else 'FAIL'} ({bfd / bound:.4f})")
    print(f"target bfd <= 0.60 x padded: {'PASS' if ok_ratio else 'FAIL'} ({bfd / padded:.3f})")
    return 0 if ok_bound and ok_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
