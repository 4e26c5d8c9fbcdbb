"""A rank's private memory over a full epoch, for a corpus and one 10x larger, side by side.

    python bench/corpus_memory.py [--docs 20000] [--scale 10] [--ranks 2]

Builds two tokenized corpora (text rows, the same tokenizer) with load_corpus, then starts
`--ranks` processes per corpus that each do what a training rank does with its data: memory-map
the corpus, build the sampler, and build every micro-batch of one epoch (its own slice). Each
reports RssAnon (anonymous, private memory) after the epoch; token pages are file-backed and
shared through the page cache, so they do not count. Target: RssAnon grows < 10% for 10x the data.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rank_epoch(manifest: str, rank: int, world: int, budget: int, out) -> None:
    import torch  # noqa: F401 - a training rank has torch loaded; count it in both runs alike

    from entrypoint.data.corpus import read_corpus
    from entrypoint.data.micro_batches import build_micro_batch
    from entrypoint.data.sampler import PackedSampler

    before = rss("RssAnon")
    corpus = read_corpus(Path(manifest))
    sampler = PackedSampler(corpus.lengths, "bfd", budget, 10000, 0, world, rank, 1)
    steps = len(sampler.epoch_bins(0)) // world
    tokens = 0
    for _ in range(steps):
        _epoch, bins = sampler.next_step()
        for ids in bins:
            tokens += build_micro_batch(corpus, ids, packed=True, budget=budget, pad_token_id=0).n_real
    out.put({"rank": rank, "docs": len(corpus), "tokens": tokens, "rss_anon": rss("RssAnon"),
             "rss_file": rss("RssFile"), "rss_anon_before": before})


def build(root: Path, docs: int, tokenizer) -> str:
    from contracts.finetune_config import build_config
    from entrypoint.data.corpus_build import build as build_corpus

    data = root / f"text-{docs}.jsonl"
    words = "the a model token data train loss step batch pack learn rate cat dog sun moon tree river".split()
    with data.open("w") as fh:
        for i in range(docs):
            n = 20 + (i * 7919) % 200
            fh.write(json.dumps({"text": " ".join(words[(i + k) % len(words)] for k in range(n))}) + "\n")
    cfg = build_config([{"model": {"path": "m"}, "data": {"path": str(data), "schema": "text", "max_length": 512},
                         "packing": {"budget": 512}}])
    return str(build_corpus(cfg, tokenizer, root / "cache", log=lambda m: None).train)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from tests.fixtures.chat import write_tokenizer

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-corpus-memory-") as tmp:
        root = Path(tmp)
        write_tokenizer(root / "tok", ["the a model token data train loss step batch pack learn rate"] * 50)
        tokenizer = AutoTokenizer.from_pretrained(str(root / "tok"))   # a tokenizer folder, no model
        ctx = mp.get_context("spawn")
        for docs in (args.docs, args.docs * args.scale):
            manifest = build(root, docs, tokenizer)
            queue = ctx.Queue()
            procs = [ctx.Process(target=rank_epoch, args=(manifest, r, args.ranks, 512, queue))
                     for r in range(args.ranks)]
            for p in procs:
                p.start()
            got = [queue.get(timeout=1800) for _ in procs]
            for p in procs:
                p.join()
            results[docs] = sorted(got, key=lambda g: g["rank"])
    small, large = results[args.docs], results[args.docs * args.scale]
    print(f"{args.ranks} ranks, one epoch each, packed 512-token rows")
    for docs, rows in results.items():
        for r in rows:
            print(f"  {docs:>8} docs  rank {r['rank']}: {r['tokens']:>11,} tokens  "
                  f"RssAnon {r['rss_anon'] / 2**20:7.1f} MiB  RssFile {r['rss_file'] / 2**20:7.1f} MiB")
    growth = max(b["rss_anon"] / a["rss_anon"] for a, b in zip(small, large))
    print(f"RssAnon growth for {args.scale}x the corpus: {growth:.3f}x; target < 1.10: "
          f"{'PASS' if growth < 1.10 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
