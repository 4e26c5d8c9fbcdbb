"""Chat rows -> tokenized documents with assistant-only labels.

Rows follow the ultrachat_200k shape: `messages`, a list of {role, content}. Each row is
rendered with the tokenizer's chat template and tokenized once. Labels keep the tokens
of every assistant reply plus the end-of-turn token that closes it (the model must learn
to stop); everything else is -100.

Bad rows never crash the run and are never silently dropped: each is counted under a
reason in BadRows, which the run report and the console carry.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contracts.collate import IGNORE_INDEX

ROLES = ("system", "user", "assistant", "tool")


class DataError(Exception):
    """The data source as a whole is unusable (missing file, unreadable format)."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}\n  fix: {fix}")
        self.fix = fix


@dataclass(kw_only=True)
class BadRows:
    """Rows that did not become a document as given, counted per reason."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)  # first few row numbers per reason
    truncated: int = 0                                              # over-long rows kept, cut to max_length

    def add(self, reason: str, row: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 5:
            ex.append(row)

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"skipped": self.skipped, "truncated": self.truncated, "by_reason": dict(self.counts),
                "example_rows": {k: list(v) for k, v in self.examples.items()}}


@dataclass(kw_only=True)
class Corpus:
    """All documents in flat arrays: document i is tokens[offsets[i]:offsets[i+1]].

    Flat int32 arrays instead of Python lists: ultrachat_200k is ~300M tokens, which as
    Python ints would need ~10 GB per rank.
    """

    tokens: np.ndarray        # int32 [total]
    labels: np.ndarray        # int32 [total], IGNORE_INDEX where no loss
    offsets: np.ndarray       # int64 [n_docs + 1]
    rows: np.ndarray          # int64 [n_docs], source row number of each document
    bad: BadRows
    n_rows: int

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int):
        from contracts.collate import Document

        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Document(input_ids=self.tokens[a:b].tolist(), labels=self.labels[a:b].tolist())

    def fingerprint(self) -> dict:
        """Identity of the tokenized data, checked on resume so a changed dataset is caught."""
        import hashlib

        h = hashlib.sha256(self.offsets.tobytes())
        h.update(self.tokens[: 1 << 20].tobytes())
        return {"n_docs": len(self), "n_tokens": int(self.offsets[-1]), "sha256": h.hexdigest()[:16]}


def read_rows(path: str, fmt: str = "auto", max_rows: int = 0, max_row_bytes: int = 8 << 20,
              progress=None, max_row_group_bytes: int = 1 << 30) -> Iterator[tuple[int, object]]:
    """Yield (row_number, row). A line that does not parse yields its raw text (or None when it
    is not UTF-8, or a TooLarge marker when it is over max_row_bytes), and the validator counts
    it: one bad line must not stop the file, and no line is ever held in memory whole beyond
    the limit. `progress(done_bytes, total_bytes)` is called as the file is read."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {p} does not exist", "set data.path to a mounted .jsonl or .parquet file")
    if fmt == "auto":
        fmt = "parquet" if p.suffix == ".parquet" else "jsonl"
    count = 0
    if fmt == "parquet":
        yield from _parquet_rows(p, max_rows, max_row_group_bytes)
        return
    total = p.stat().st_size
    with p.open("rb") as fh:
        while True:
            raw = fh.readline(max_row_bytes + 1)
            if not raw:
                return
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                while (more := fh.readline(1 << 20)) and not more.endswith(b"\n"):
                    pass  # skip the rest of the line without keeping it
                row: object = TooLarge(max_row_bytes)
            else:
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    row = None
                else:
                    try:
                        row = json.loads(text)
                    except (json.JSONDecodeError, RecursionError):
                        row = text
            if max_rows and count >= max_rows:
                return
            yield count, row
            count += 1
            if progress is not None and count % 256 == 0:
                progress(fh.tell(), total)


@dataclass(frozen=True)
class TooLarge:
    limit: int


def _parquet_rows(p: Path, max_rows: int, max_row_group_bytes: int = 1 << 30) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(str(p))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"cannot read parquet {p}: {exc}", "check the file, or set data.format=jsonl") from None
    # a row group is read whole: one that would not fit is refused from the footer, unread
    for i in range(table.metadata.num_row_groups):
        size = table.metadata.row_group(i).total_byte_size
        if size > max_row_group_bytes:
            raise DataError(f"{p} row group {i} is {size / 2 ** 20:.0f} MiB uncompressed, over "
                            f"data.max_row_group_bytes ({max_row_group_bytes / 2 ** 20:.0f} MiB)",
                            "rewrite the file with smaller row groups (pyarrow row_group_size), or raise "
                            "data.max_row_group_bytes if this host has the memory")
    count = 0
    for batch in table.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            if max_rows and count >= max_rows:
                return
            yield count, row
            count += 1


def validate_row(row: object, messages_field: str, max_messages: int = 4096) -> tuple[list[dict] | None, str]:
    """Return (messages, "") or (None, reason)."""
    if isinstance(row, TooLarge):
        return None, "row_too_large"
    if row is None:
        return None, "not_utf8"
    if not isinstance(row, dict):
        return None, "invalid_json" if isinstance(row, str) else "not_an_object"
    messages = row.get(messages_field)
    if messages is None:
        return None, "missing_messages"
    if not isinstance(messages, list):
        return None, "messages_not_a_list"
    if not messages:
        return None, "empty_messages"
    if len(messages) > max_messages:
        return None, "too_many_messages"
    clean = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, "malformed_message"
        if m["role"] not in ROLES:
            return None, "unknown_role"
        if not m["content"].strip():
            return None, "empty_content"
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:   # a lone surrogate ("\\ud800" in the JSON) cannot be tokenized
            return None, "undecodable_text"
        clean.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in clean):
        return None, "no_assistant_turn"
    return clean, ""


def end_of_turn_token(tokenizer, configured: str) -> str:
    if configured != "auto":
        return configured
    if "<|im_end|>" in tokenizer.get_vocab():
        return "<|im_end|>"
    return tokenizer.eos_token or ""


def label_tokens(offsets: np.ndarray, ids: np.ndarray, spans) -> np.ndarray:
    """-100 except tokens whose first character lies inside an assistant span (chat_mask's rule)."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
    if not spans:
        return labels
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    tok_start = offsets[:, 0]
    k = np.searchsorted(starts, tok_start, side="right") - 1
    inside = (k >= 0) & (tok_start < ends[np.clip(k, 0, None)]) & (offsets[:, 1] > offsets[:, 0])
    labels[inside] = ids[inside]
    return labels


def tokenize_rows(rows: Iterator[tuple[int, object]], tokenizer, *, messages_field: str = "messages",
                  max_length: int = 8192, overlong: str = "truncate", end_of_turn: str = "auto",
                  batch_size: int = 512, on_row=None, max_messages: int = 4096) -> Corpus:
    """`on_row(rows_read)` is called after each row (progress)."""
    from entrypoint.chat_mask import Unmaskable, render

    eot = end_of_turn_token(tokenizer, end_of_turn)
    bad = BadRows()
    tok_chunks, lab_chunks, lengths, row_ids = [], [], [], []
    n_rows = 0
    pending: list[tuple[int, str, tuple]] = []

    def flush():
        if not pending:
            return
        enc = tokenizer([t for _, t, _ in pending], add_special_tokens=False, return_offsets_mapping=True)
        for (row, _text, spans), ids, offs in zip(pending, enc["input_ids"], enc["offset_mapping"]):
            ids = np.asarray(ids, dtype=np.int32)
            labels = label_tokens(np.asarray(offs, dtype=np.int64).reshape(-1, 2), ids, spans)
            if len(ids) > max_length:
                if overlong == "skip":
                    bad.add("overlong", row)
                    continue
                ids, labels = ids[:max_length], labels[:max_length]
                if not (labels[1:] != IGNORE_INDEX).any():
                    bad.add("overlong_no_loss_after_truncation", row)
                    continue
                bad.truncated += 1
            if not (labels[1:] != IGNORE_INDEX).any():
                bad.add("no_loss_tokens", row)
                continue
            tok_chunks.append(ids)
            lab_chunks.append(labels)
            lengths.append(len(ids))
            row_ids.append(row)
        pending.clear()

    for row, raw in rows:
        n_rows += 1
        if on_row is not None:
            on_row(n_rows)
        messages, reason = validate_row(raw, messages_field, max_messages)
        if messages is None:
            bad.add(reason, row)
            continue
        try:
            rendered = render(tokenizer, messages, eot)
        except Unmaskable as exc:
            bad.add(exc.reason, row)
            continue
        except Exception:  # noqa: BLE001 - jinja raises arbitrary exceptions (raise_exception on role order)
            bad.add("chat_template_rejected", row)
            continue
        pending.append((row, rendered.text, rendered.spans))
        if len(pending) >= batch_size:
            flush()
    flush()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    empty = np.zeros(0, dtype=np.int32)
    return Corpus(
        tokens=np.concatenate(tok_chunks) if tok_chunks else empty,
        labels=np.concatenate(lab_chunks) if lab_chunks else empty,
        offsets=offsets, rows=np.asarray(row_ids, dtype=np.int64), bad=bad, n_rows=n_rows,
    )


def load_corpus(cfg, tokenizer, log=None) -> Corpus:
    """Build the corpus described by a DataConfig; `log` (a contracts.events.EventLog) gets
    tokenisation progress with rows/s and an ETA from the bytes read."""
    progress = None
    if log is not None:
        from contracts.events import Progress

        progress = Progress(log, "tokenize", Path(cfg.path).name, min_interval=2.0)

    def read_progress(done: int, total: int) -> None:
        if progress is not None:
            rows_per_s = progress_rows[0] / max(progress.elapsed, 1e-6)
            progress.update(done, f"{progress_rows[0]} rows, {rows_per_s:.0f} rows/s", total=total)

    progress_rows = [0]

    def on_row(n: int) -> None:
        progress_rows[0] = n

    corpus = tokenize_rows(
        read_rows(cfg.path, cfg.format, cfg.max_rows, cfg.max_row_bytes, read_progress, cfg.max_row_group_bytes),
        tokenizer, messages_field=cfg.messages_field, max_length=cfg.max_length, overlong=cfg.overlong,
        end_of_turn=cfg.end_of_turn, on_row=on_row, max_messages=cfg.max_messages,
    )
    if progress is not None:
        progress.finish(f"{corpus.n_rows} rows -> {len(corpus)} documents, {int(corpus.offsets[-1])} tokens")
    if len(corpus) == 0:
        raise DataError(
            f"no usable rows in {cfg.path} ({corpus.n_rows} read; bad: {corpus.bad.counts})",
            f"check that rows have a `{cfg.messages_field}` list of {{role, content}} with an assistant turn",
        )
    return corpus


def corpus_key(cfg, tokenizer) -> str:
    """Content key of a tokenized corpus: the data file's identity, the data options and
    the tokenizer (vocab, merges, chat template). Any change re-tokenizes."""
    import hashlib
    import os

    st = os.stat(cfg.path)
    h = hashlib.sha256()
    h.update(json.dumps([os.path.abspath(cfg.path), st.st_size, st.st_mtime_ns, cfg.format, cfg.messages_field,
                         cfg.max_length, cfg.overlong, cfg.end_of_turn, cfg.max_rows, cfg.max_messages,
                         tokenizer.chat_template]).encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    return h.hexdigest()[:24]


def save_corpus(corpus: Corpus, path: Path) -> None:
    """Atomic .npz write (contracts.atomic), so a reader never sees half a file."""
    import io

    from contracts import atomic

    buffer = io.BytesIO()
    np.savez(buffer, tokens=corpus.tokens, labels=corpus.labels, offsets=corpus.offsets, rows=corpus.rows,
             meta=np.array(json.dumps({"bad": corpus.bad.to_dict(), "n_rows": corpus.n_rows,
                                       "counts": corpus.bad.counts, "examples": corpus.bad.examples})))
    atomic.write_bytes(path, buffer.getvalue())


def read_corpus(path: Path) -> Corpus:
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        bad = BadRows(counts=meta["counts"], examples=meta["examples"], truncated=meta["bad"]["truncated"])
        return Corpus(tokens=z["tokens"], labels=z["labels"], offsets=z["offsets"], rows=z["rows"], bad=bad,
                      n_rows=meta["n_rows"])
