"""`inspect-data`: see exactly what the trainer will train on.

    python -m entrypoint inspect-data --config X [--rows N] [--json]
    docker run IMAGE inspect-data --config /data/finetune.yaml --rows 5

Renders the first N documents as the trainer sees them (same reading, validation, template
and mask code), with the trained tokens marked: coloured in a terminal, [[brackets]]
otherwise. --json prints, per document, the row number, the token count, the loss-token
count and the decoded text of each trained span. Both end with a summary: rows read,
documents, bad rows by reason, truncated rows, loss tokens in total.
"""
from __future__ import annotations

import json
import sys
from itertools import islice

import numpy as np

from contracts.collate import IGNORE_INDEX
from entrypoint.data.corpus_build import load_corpus

TRAINED_TTY = ("\033[1;42;30m", "\033[0m")   # bold, green background
TRAINED_PLAIN = ("[[", "]]")


def runs(labels: np.ndarray) -> list[tuple[int, int, bool]]:
    """Contiguous (start, end, trained) token runs."""
    trained = labels != IGNORE_INDEX
    out, start = [], 0
    for i in range(1, len(trained) + 1):
        if i == len(trained) or trained[i] != trained[start]:
            out.append((start, i, bool(trained[start])))
            start = i
    return out


def document_view(tokenizer, ids: np.ndarray, labels: np.ndarray, *, colour: bool) -> str:
    """The document's text with each trained run wrapped in markers (runs are decoded whole,
    so multi-byte characters split across tokens decode correctly)."""
    left, right = TRAINED_TTY if colour else TRAINED_PLAIN
    parts = []
    for start, end, trained in runs(labels):
        text = tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False)
        parts.append(f"{left}{text}{right}" if trained else text)
    return "".join(parts)


def document_record(tokenizer, row: int, ids: np.ndarray, labels: np.ndarray) -> dict:
    return {"row": int(row), "tokens": int(len(ids)), "loss_tokens": int((labels[1:] != IGNORE_INDEX).sum()),
            "trained_spans": [tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=False)
                              for s, e, trained in runs(labels) if trained]}


def inspect(cfg, tokenizer, *, rows: int, as_json: bool, colour: bool, out=sys.stdout) -> dict:
    """Tokenize the whole configured data (so the summary counts every row), show the first `rows`."""
    corpus = load_corpus(cfg, tokenizer)
    shown = []
    for i in islice(range(len(corpus)), rows):
        ids, labels = corpus.doc_tokens(i), corpus.doc_labels(i)
        shown.append(document_record(tokenizer, corpus.rows[i], ids, labels))
        if not as_json:
            out.write(f"--- document {i} (row {int(corpus.rows[i])}, {len(ids)} tokens, "
                      f"{shown[-1]['loss_tokens']} trained) ---\n")
            out.write(document_view(tokenizer, ids, labels, colour=colour) + "\n")
    summary = {"rows_read": corpus.n_rows, "documents": len(corpus),
               "bad_rows": dict(corpus.bad.counts), "truncated": corpus.bad.truncated,
               "reasoning_dropped": corpus.bad.reasoning_dropped,
               "loss_tokens": sum(int((corpus.doc_labels(i)[1:] != IGNORE_INDEX).sum()) for i in range(len(corpus))),
               "tokens": corpus.n_tokens}
    if as_json:
        out.write(json.dumps({"documents": shown, "summary": summary}, indent=2, ensure_ascii=False) + "\n")
    else:
        bad = ", ".join(f"{k}: {v}" for k, v in sorted(summary["bad_rows"].items())) or "none"
        marker = "green" if colour else "[[ ]]"
        out.write(f"--- summary: {summary['rows_read']} rows read, {summary['documents']} documents, bad rows: "
                  f"{bad}; truncated: {summary['truncated']}; {summary['loss_tokens']} loss tokens of "
                  f"{summary['tokens']} (trained tokens are marked {marker}) ---\n")
    return summary
