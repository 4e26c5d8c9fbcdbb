"""The tokenized corpus: documents as views into memory-mapped Arrow files, never copied per rank.

A tokenized source is what `Dataset.map` wrote: Arrow stream files with one row per input row
(`input_ids` and `labels` as list<int32>, the source `row`, and the `bad` reason for rows that
did not become a document). Every rank memory-maps the same files: token pages are shared
through the page cache and count as file-backed memory, not as each rank's anonymous memory,
so a 10x larger corpus does not make a rank 10x larger.

A run's corpus is a selection of documents from one or more sources (a mixture repeats some;
an eval split takes others away), recorded as a manifest (JSON) plus the selection (.npy).
Per document the corpus keeps only (shard, start, length, row): 22 bytes.
"""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contracts import atomic


@dataclass(kw_only=True)
class BadRows:
    """Rows that did not become a document as given, counted per reason."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)  # first few row numbers per reason
    truncated: int = 0                                              # over-long rows kept, cut to max_length
    reasoning_dropped: int = 0                                      # reasoning the chat template did not render

    def add(self, reason: str, row: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 5:
            ex.append(int(row))

    def merge(self, other: BadRows) -> None:
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            ex = self.examples.setdefault(reason, [])
            ex.extend(other.examples.get(reason, [])[:5 - len(ex)])
        self.truncated += other.truncated
        self.reasoning_dropped += other.reasoning_dropped

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"skipped": self.skipped, "truncated": self.truncated, "reasoning_dropped": self.reasoning_dropped,
                "by_reason": dict(self.counts), "example_rows": {k: list(v) for k, v in self.examples.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> BadRows:
        return cls(counts=dict(data.get("by_reason", {})), examples={k: list(v) for k, v in
                                                                     data.get("example_rows", {}).items()},
                   truncated=int(data.get("truncated", 0)), reasoning_dropped=int(data.get("reasoning_dropped", 0)))


@dataclass
class Shard:
    tokens: np.ndarray        # int32, flat (a view into a memory-mapped Arrow buffer)
    labels: np.ndarray        # int32, flat, IGNORE_INDEX where no loss


class Corpus:
    """Documents i = 0..n-1, each a slice of one shard's flat token and label arrays."""

    def __init__(self, shards: list[Shard], doc_shard: np.ndarray, doc_start: np.ndarray, lengths: np.ndarray,
                 rows: np.ndarray, *, bad: BadRows | None = None, n_rows: int = 0, identity: str = ""):
        self.shards = shards
        self.doc_shard = doc_shard
        self.doc_start = doc_start
        self.lengths = lengths
        self.rows = rows
        self.bad = bad or BadRows()
        self.n_rows = n_rows
        self.identity = identity
        self._single = shards[0] if len(shards) == 1 else None

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, labels: np.ndarray, offsets: np.ndarray, rows: np.ndarray,
                    bad: BadRows | None = None, n_rows: int = 0) -> Corpus:
        """One in-memory shard from flat arrays (document i is tokens[offsets[i]:offsets[i+1]])."""
        n = len(offsets) - 1
        return cls([Shard(tokens, labels)], np.zeros(n, dtype=np.int32), np.asarray(offsets[:-1], dtype=np.int64),
                   np.diff(offsets).astype(np.int64), np.asarray(rows, dtype=np.int64), bad=bad, n_rows=n_rows)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def offsets(self) -> np.ndarray:
        """Start of each document in the flat `tokens`/`labels` below, and the end (n + 1 values)."""
        out = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def _flat(self, which: str) -> np.ndarray:
        """Every document's tokens (or labels) in order: a view when they already lie so in one
        shard, else a copy (inspect-data and tests; training reads per document)."""
        if self._single is not None and len(self) and self.doc_start[0] == 0 and \
                np.array_equal(self.doc_start[1:], np.cumsum(self.lengths)[:-1]):
            return getattr(self._single, which)[:self.n_tokens]
        get = self.doc_tokens if which == "tokens" else self.doc_labels
        return np.concatenate([get(i) for i in range(len(self))]) if len(self) else np.zeros(0, dtype=np.int32)

    @property
    def tokens(self) -> np.ndarray:
        return self._flat("tokens")

    @property
    def labels(self) -> np.ndarray:
        return self._flat("labels")

    def doc_tokens(self, i: int) -> np.ndarray:
        shard = self._single or self.shards[self.doc_shard[i]]
        a = int(self.doc_start[i])
        return shard.tokens[a:a + int(self.lengths[i])]

    def doc_labels(self, i: int) -> np.ndarray:
        shard = self._single or self.shards[self.doc_shard[i]]
        a = int(self.doc_start[i])
        return shard.labels[a:a + int(self.lengths[i])]

    def document(self, i: int):
        # contracts.collate imports torch: the launcher resolves and reads corpora through this module first
        from contracts.collate import Document

        return Document(input_ids=self.doc_tokens(i).tolist(), labels=self.doc_labels(i).tolist())

    def select(self, ids: np.ndarray) -> Corpus:
        """The documents `ids` (in that order; repeats allowed), sharing the same shards."""
        ids = np.asarray(ids, dtype=np.int64)
        return Corpus(self.shards, self.doc_shard[ids], self.doc_start[ids], self.lengths[ids], self.rows[ids],
                      bad=self.bad, n_rows=self.n_rows, identity=self.identity)

    def fingerprint(self) -> dict:
        """Identity of the tokenized data, checked on resume so a changed dataset is caught."""
        h = hashlib.sha256(self.identity.encode())
        h.update(self.lengths.tobytes())
        for i in range(min(len(self), 256)):
            h.update(self.doc_tokens(i).tobytes())
        return {"n_docs": len(self), "n_tokens": self.n_tokens, "sha256": h.hexdigest()[:16]}


# ---- on disk -------------------------------------------------------------------------------------

def _open_arrow(path: str):
    """A table whose buffers live in the memory-mapped file (Arrow stream or file format)."""
    import pyarrow as pa  # when a corpus is opened: the launcher resolves its data sources through this module

    source = pa.memory_map(path, "r")
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()


def open_source(files: list[str]) -> tuple[list[Shard], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shards and per-document arrays (shard, start, length, row) for the good rows of a tokenized
    source, in row order, zero-copy."""
    import pyarrow as pa  # see _open_arrow

    shards: list[Shard] = []
    doc_shard, doc_start, lengths, rows = [], [], [], []
    for path in files:
        table = _open_arrow(path)
        ids_col, lab_col = table.column("input_ids"), table.column("labels")
        bad_col, row_col = table.column("bad"), table.column("row")
        for chunk in range(ids_col.num_chunks):
            ids, labs = ids_col.chunk(chunk), lab_col.chunk(chunk)
            if len(ids) == 0:
                continue
            offsets = ids.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
            good = bad_col.chunk(chunk).to_numpy(zero_copy_only=False) == ""
            values = ids.values.to_numpy(zero_copy_only=True)
            label_values = labs.values.to_numpy(zero_copy_only=True)
            if not isinstance(ids, pa.ListArray) or len(values) != len(label_values):
                raise ValueError(f"{path} is not a tokenized corpus (input_ids/labels differ)")
            shards.append(Shard(values, label_values))
            k = len(shards) - 1
            base = offsets[0]
            starts = offsets[:-1][good] - base
            doc_start.append(starts)
            lengths.append((offsets[1:] - offsets[:-1])[good])
            doc_shard.append(np.full(len(starts), k, dtype=np.int32))
            rows.append(row_col.chunk(chunk).to_numpy(zero_copy_only=False)[good].astype(np.int64))
    if not shards:
        empty = np.zeros(0, dtype=np.int64)
        return [], np.zeros(0, dtype=np.int32), empty, empty, empty
    return shards, np.concatenate(doc_shard), np.concatenate(doc_start), np.concatenate(lengths), \
        np.concatenate(rows)


def write_manifest(path: Path, *, sources: list[dict], selection: np.ndarray, bad: BadRows, n_rows: int,
                   identity: str) -> Path:
    """The run's corpus: its sources' Arrow files, which documents (selection.npy), the bad rows."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(selection, dtype=np.int64), allow_pickle=False)
    atomic.write_bytes(path.with_suffix(".npy"), buffer.getvalue())
    atomic.write_json(path, {"format": 1, "sources": sources, "selection": path.with_suffix(".npy").name,
                             "bad": bad.to_dict(), "n_rows": n_rows, "identity": identity}, sort_keys=True)
    return path


def read_corpus(path: Path) -> Corpus:
    """Open a run's corpus manifest (workers call this; nothing is copied into private memory)."""
    manifest = json.loads(Path(path).read_text())
    shards: list[Shard] = []
    parts = []
    for source in manifest["sources"]:
        s_shards, s_shard, s_start, s_len, s_rows = open_source(source["files"])
        parts.append((s_shard + len(shards), s_start, s_len, s_rows))
        shards.extend(s_shards)
    doc_shard = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int32)
    doc_start = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    lengths = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    rows = np.concatenate([p[3] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    selection = np.load(Path(path).with_name(manifest["selection"]), allow_pickle=False)
    whole = Corpus(shards, doc_shard, doc_start, lengths, rows, bad=BadRows.from_dict(manifest["bad"]),
                   n_rows=int(manifest["n_rows"]), identity=manifest["identity"])
    return whole.select(selection)
