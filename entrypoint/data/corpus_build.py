"""The run's training and evaluation corpora, built once by the launcher before any rank starts.

1. Every source is resolved first (data.path or each data.sources entry, and data.eval_path), so
   bad input is refused before anything is tokenized.
2. Each source is tokenized by Dataset.map into Arrow files, reused on a rerun (data.py).
3. data.eval_fraction holds out that share of each source's documents (a permutation seeded by
   train.seed: deterministic per document); data.eval_path is a source of its own.
4. A mixture takes each source's share of the documents by weight: with N documents in all, source
   i contributes round(N * w_i / sum(w)) of them (largest remainders, in exact fractions, so no
   weight overflows or underflows), so shares are exact to one document. A source with fewer
   documents than its share starts another pass (reshuffled), and the log says so.
The result is two manifests (corpus.py) the workers memory-map.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from contracts.finetune_config import DataConfig, FinetuneConfig, SourceConfig
from entrypoint.data.corpus import BadRows, Corpus, open_source, read_corpus, write_manifest
from entrypoint.data.sources import DataError, Source, resolve
from verify.scratch import private_scratch


@dataclass(frozen=True)
class Built:
    train: Path
    eval: Path | None


def source_specs(data) -> list[tuple[str, object]]:
    """(field, spec) for each training source: data.sources entries, or data.path as one."""
    if data.sources:
        return [(f"data.sources[{i}]", s) for i, s in enumerate(data.sources)]
    return [("data", SourceConfig(path=data.path, weight=1.0, format=data.format, schema="", split=data.split))]


def resolve_all(data) -> tuple[list[tuple[Source, object]], Source | None]:
    sources = [(resolve(spec.path, spec.format, spec.split, f"{field}.path" if field != "data" else "data.path"),
                spec) for field, spec in source_specs(data)]
    held_out = resolve(data.eval_path, data.format, "", "data.eval_path") if data.eval_path else None
    return sources, held_out


def quotas(sizes: list[int], weights: list[float]) -> list[int]:
    """Documents per source: N = sum(sizes) shared by weight, largest remainders (sums to N).
    Exact rational arithmetic: weights of 1e308 (whose float sum is inf) or of 5e-324 (whose
    shares underflow) get the same quotas as 1 and 1."""
    total = sum(sizes)
    exact = [Fraction(w) for w in weights]      # every finite float is exactly a fraction
    scale = sum(exact)
    shares = [w * total / scale for w in exact]
    counts = [int(s) for s in shares]           # floor: shares are >= 0
    by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])   # stable: ties keep order
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def draw(ids: np.ndarray, count: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """`count` of `ids`, pass after pass, each pass reshuffled. Returns (chosen, passes)."""
    if count == 0 or len(ids) == 0:
        return np.zeros(0, dtype=np.int64), 0
    passes = -(-count // len(ids))
    chosen = np.concatenate([ids[rng.permutation(len(ids))] for _ in range(passes)])[:count]
    return chosen, passes


def split_eval(n_docs: int, fraction: float, seed: int, salt: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, eval ids) of one source: a seeded permutation, round(n * fraction) held out."""
    order = np.random.default_rng([seed, 1 << 20, salt]).permutation(n_docs)
    k = int(round(n_docs * fraction)) if fraction else 0
    if fraction and n_docs >= 2:
        k = min(max(k, 1), n_docs - 1)
    return np.sort(order[k:]), np.sort(order[:k])


def build(cfg, tokenizer, cache_dir: Path, *, log: Callable[[str], None], events=None) -> Built:
    # tokenize imports torch (contracts.collate): the launcher resolves sources here before it needs torch
    from entrypoint.data.tokenize import tokenize_source

    data = cfg.data
    sources, held_out = resolve_all(data)
    tokenized, sizes, bad, n_rows = [], [], BadRows(), 0
    for source, spec in sources:
        done = tokenize_source(source, tokenizer, data, cache_dir, schema=spec.schema or data.schema, events=events)
        tokenized.append(done)
        sizes.append(len(open_source(done["files"])[3]))
        bad.merge(BadRows.from_dict(done["bad"]))
        n_rows += done["n_rows"]
    bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    train_parts, eval_parts = [], []
    for i, n in enumerate(sizes):
        train_ids, eval_ids = split_eval(n, data.eval_fraction, cfg.train.seed, i)
        train_parts.append(train_ids + bases[i])
        eval_parts.append(eval_ids + bases[i])
    if len(sources) > 1:
        counts = quotas([len(p) for p in train_parts], [spec.weight for _, spec in sources])
        rng = np.random.default_rng([cfg.train.seed, 1 << 21])
        chosen = []
        for (source, spec), ids, count in zip(sources, train_parts, counts):
            picked, passes = draw(ids, count, rng)
            chosen.append(picked)
            share = count / max(sum(counts), 1)
            note = f"; it has {len(ids)}, so it runs {passes} passes" if passes > 1 else ""
            log(f"[finetune] data mixture: {source.field.removesuffix('.path')} ({source.path}) gives {count} "
                f"documents ({share:.1%}, weight {spec.weight:g}){note}")
        selection = np.concatenate(chosen)
    else:
        selection = train_parts[0]
    identity = hashlib.sha256(json.dumps([[t["fingerprint"] for t in tokenized],
                                          [spec.weight for _, spec in sources], data.eval_fraction,
                                          cfg.train.seed]).encode()).hexdigest()[:32]
    manifests = [{"files": t["files"], "fingerprint": t["fingerprint"], "source": t["source"]} for t in tokenized]
    train = write_manifest(cache_dir / f"run-{identity}-train.json", sources=manifests, selection=selection, bad=bad,
                           n_rows=n_rows, identity=identity)
    evaluation = None
    if held_out is not None:
        done = tokenize_source(held_out, tokenizer, data, cache_dir, schema=data.schema, events=events)
        n = len(open_source(done["files"])[3])
        evaluation = write_manifest(cache_dir / f"run-{identity}-eval.json",
                                    sources=[{"files": done["files"], "fingerprint": done["fingerprint"],
                                              "source": done["source"]}],
                                    selection=np.arange(n), bad=BadRows.from_dict(done["bad"]),
                                    n_rows=done["n_rows"], identity=done["fingerprint"])
    elif data.eval_fraction:
        evaluation = write_manifest(cache_dir / f"run-{identity}-eval.json", sources=manifests,
                                    selection=np.concatenate(eval_parts), bad=BadRows(), n_rows=0,
                                    identity=identity + "-eval")
    return Built(train=train, eval=evaluation)




def load_corpus(cfg, tokenizer, events=None, cache_dir: Path | None = None) -> Corpus:
    """The training corpus `cfg` describes (a FinetuneConfig, or just its DataConfig), built through
    datasets into `cache_dir` (default: this user's private scratch)."""
    if isinstance(cfg, DataConfig):
        cfg = FinetuneConfig(data=cfg)
    if cache_dir is None:
        cache_dir = private_scratch() / "datasets"
    cache_dir.mkdir(parents=True, exist_ok=True)
    corpus = read_corpus(build(cfg, tokenizer, cache_dir, log=lambda _m: None, events=events).train)
    if len(corpus) == 0:
        where = cfg.data.path or ", ".join(s.path for s in cfg.data.sources)
        raise DataError(f"no usable rows in {where} ({corpus.n_rows} read; bad: {corpus.bad.counts})",
                        f"check that the rows match data.schema={cfg.data.schema} (inspect-data shows each row's "
                        "verdict)")
    return corpus


__all__ = ["Built", "build", "load_corpus", "read_corpus", "resolve_all"]
