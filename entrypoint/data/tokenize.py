"""Rows -> tokenized documents with assistant-only labels, through `datasets`.

Rows come from the one row reader (rows.py), where a JSON line that does not parse, is not UTF-8
or is longer than data.max_row_bytes is a counted bad row, never read into memory whole. Each row
is mapped to one shape by its row format (row_formats.py), rendered with the tokenizer's own chat template, and masked
(chat_mask.py): labels keep the tokens of every assistant reply plus the end-of-turn token that
closes it; everything else is -100. Tokenisation runs as `Dataset.map(num_proc=...)` with an
explicit fingerprint (the data files' content, the tokenizer, the data options), so a rerun reuses
the Arrow files and any change re-tokenizes; the result is memory-mapped (corpus.py).

Bad rows never crash the run and are never silently dropped: each is counted under a reason in
BadRows, which the run report, the console and inspect-data carry.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contracts import atomic
from contracts.collate import IGNORE_INDEX
from entrypoint.data.chat_mask import Unmaskable, render, special_texts
from entrypoint.data.corpus import BadRows, Corpus
from entrypoint.data.row_formats import BadRow, Chat, Plain, convert
from entrypoint.data.rows import TooLarge, load_rows, parse_line, row_problem

IGNORE = IGNORE_INDEX
__all__ = ["BadRows", "Corpus", "IGNORE", "TooLarge", "tokenize_rows"]


def validate_row(row: object, messages_field: str, max_messages: int = 4096) -> tuple[list[dict] | None, str]:
    """Return (messages, "") or (None, reason) for a `messages`-schema row."""
    problem = row_problem(row)
    if problem:
        return None, problem
    try:
        return convert(row, "messages", messages_field=messages_field, max_messages=max_messages).messages, ""
    except BadRow as exc:
        return None, exc.reason


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


@dataclass(frozen=True)
class EncodeOptions:
    schema: str = "messages"
    messages_field: str = "messages"
    max_length: int = 8192
    overlong: str = "truncate"
    end_of_turn: str = "auto"
    max_messages: int = 4096

    @classmethod
    def of(cls, cfg, schema: str | None = None) -> EncodeOptions:
        return cls(schema=schema or cfg.schema, messages_field=cfg.messages_field, max_length=cfg.max_length,
                   overlong=cfg.overlong, end_of_turn=cfg.end_of_turn, max_messages=cfg.max_messages)


def _render(row: object, tokenizer, opts: EncodeOptions, eot: str):
    """(text, spans, reasoning_dropped) of one row, or BadRow."""
    problem = row_problem(row)
    if problem:
        raise BadRow(problem)
    shaped = convert(row, opts.schema, messages_field=opts.messages_field, max_messages=opts.max_messages)
    if isinstance(shaped, Plain):
        for text in special_texts(tokenizer):
            if text in shaped.prompt or text in shaped.completion:
                raise BadRow("content_has_special_token")
        eos = tokenizer.eos_token or ""
        text = shaped.prompt + shaped.completion + eos
        return text, ((len(shaped.prompt), len(text)),), 0
    assert isinstance(shaped, Chat)
    try:
        rendered = render(tokenizer, shaped.messages, eot)
    except Unmaskable as exc:
        raise BadRow(exc.reason) from None
    except Exception:  # noqa: BLE001 - jinja raises arbitrary exceptions (raise_exception on role order)
        raise BadRow("chat_template_rejected") from None
    return rendered.text, rendered.spans, rendered.reasoning_dropped


def encode(rows: list[tuple[int, object]], tokenizer, opts: EncodeOptions) -> list[dict]:
    """Each row as {row, input_ids, labels, bad, truncated, reasoning_dropped}: one tokenizer call
    for the whole list. A bad row has empty ids and its reason in `bad`."""
    eot = end_of_turn_token(tokenizer, opts.end_of_turn)
    out: list[dict] = []
    pending: list[tuple[int, str, tuple]] = []
    for index, row in rows:
        empty = np.zeros(0, dtype=np.int32)   # typed even when empty: Arrow must not infer a double list
        record = {"row": int(index), "input_ids": empty, "labels": empty, "bad": "", "truncated": False,
                  "reasoning_dropped": 0}
        out.append(record)
        try:
            text, spans, dropped = _render(row, tokenizer, opts, eot)
        except BadRow as exc:
            record["bad"] = exc.reason
            continue
        record["reasoning_dropped"] = dropped
        pending.append((len(out) - 1, text, spans))
    if not pending:
        return out
    enc = tokenizer([t for _, t, _ in pending], add_special_tokens=False, return_offsets_mapping=True)
    for (k, _text, spans), ids, offs in zip(pending, enc["input_ids"], enc["offset_mapping"]):
        record = out[k]
        ids = np.asarray(ids, dtype=np.int32)
        labels = label_tokens(np.asarray(offs, dtype=np.int64).reshape(-1, 2), ids, spans)
        if len(ids) > opts.max_length:
            if opts.overlong == "skip":
                record["bad"] = "overlong"
                continue
            ids, labels = ids[:opts.max_length], labels[:opts.max_length]
            if not (labels[1:] != IGNORE_INDEX).any():
                record["bad"] = "overlong_no_loss_after_truncation"
                continue
            record["truncated"] = True
        if not (labels[1:] != IGNORE_INDEX).any():
            record["bad"] = "no_loss_tokens"
            continue
        record["input_ids"], record["labels"] = ids, labels
    return out


def tokenize_batch(batch: dict, indices: list[int], *, tokenizer, opts: EncodeOptions, raw: bool) -> dict:
    """Dataset.map's function: a batch of raw JSON lines (raw=True) or typed rows, tokenized."""
    if raw:
        rows = [(i, parse_line(text) if status == "" else (TooLarge(0) if status == "row_too_large" else None))
                for i, text, status in zip(indices, batch["raw"], batch["status"])]
    else:
        keys = list(batch)
        rows = [(i, dict(zip(keys, values))) for i, values in zip(indices, zip(*batch.values()))]
    records = encode(rows, tokenizer, opts)
    return {key: [r[key] for r in records] for key in ("row", "input_ids", "labels", "bad", "truncated",
                                                       "reasoning_dropped")}


def tokenize_rows(rows: Iterator[tuple[int, object]], tokenizer, *, messages_field: str = "messages",
                  max_length: int = 8192, overlong: str = "truncate", end_of_turn: str = "auto",
                  batch_size: int = 512, on_row=None, max_messages: int = 4096, schema: str = "messages") -> Corpus:
    """In memory (inspect-data, tests): rows -> a one-shard Corpus. `on_row(rows_read)` reports progress."""
    opts = EncodeOptions(schema=schema, messages_field=messages_field, max_length=max_length, overlong=overlong,
                         end_of_turn=end_of_turn, max_messages=max_messages)
    bad = BadRows()
    tok_chunks, lab_chunks, lengths, row_ids = [], [], [], []
    n_rows = 0
    batch: list[tuple[int, object]] = []

    def flush():
        for record in encode(batch, tokenizer, opts):
            bad.reasoning_dropped += record["reasoning_dropped"]
            if record["bad"]:
                bad.add(record["bad"], record["row"])
                continue
            bad.truncated += int(record["truncated"])
            tok_chunks.append(record["input_ids"])
            lab_chunks.append(record["labels"])
            lengths.append(len(record["input_ids"]))
            row_ids.append(record["row"])
        batch.clear()

    for row in rows:
        n_rows += 1
        if on_row is not None:
            on_row(n_rows)
        batch.append(row)
        if len(batch) >= batch_size:
            flush()
    flush()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    empty = np.zeros(0, dtype=np.int32)
    return Corpus.from_arrays(np.concatenate(tok_chunks) if tok_chunks else empty,
                              np.concatenate(lab_chunks) if lab_chunks else empty, offsets,
                              np.asarray(row_ids, dtype=np.int64), bad, n_rows)


# ---- through datasets ------------------------------------------------------------------------

def tokenizer_identity(tokenizer) -> str:
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    h.update(json.dumps([tokenizer.chat_template, tokenizer.eos_token, tokenizer.pad_token]).encode())
    return h.hexdigest()


def num_proc(configured: int) -> int:
    return configured or max(1, min(os.cpu_count() or 1, 16))


@contextmanager
def inherited_objects_left_alone(forking: bool) -> Iterator[None]:
    """Dataset.map forks its workers. A forked child that runs the garbage collector may destroy
    an object it inherited whose destructor needs a thread only the parent has (a torch gloo
    process group left in a reference cycle does: the child hangs for ever or dies). Collect in
    the parent first, and freeze what is left so the children never collect it."""
    if not forking:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def tokenize_source(source, tokenizer, cfg, cache_dir: Path, *, schema: str, events=None) -> dict:
    """One source tokenized by Dataset.map into Arrow files under cache_dir (reused when its
    fingerprint matches). Returns {files, bad, n_rows, fingerprint}."""
    opts = EncodeOptions.of(cfg, schema)
    key = hashlib.sha256(json.dumps([source.identity(), tokenizer_identity(tokenizer), opts.__dict__,
                                     cfg.max_rows, cfg.max_row_bytes, 2]).encode()).hexdigest()[:32]
    out_dir = cache_dir / f"tokenized-{key}"
    summary = out_dir / "summary.json"
    if summary.is_file() and not summary.is_symlink():
        done = json.loads(summary.read_text())
        if all(Path(f).is_file() for f in done["files"]):
            return done
    staging = atomic.staging_dir(cache_dir, f"tokenized-{key}")
    try:
        done = _tokenize_into(staging, source, tokenizer, cfg, opts, key, events)
        done["files"] = [str(out_dir / name) for name in done["files"]]
        atomic.write_json(staging / "summary.json", done, sort_keys=True)
        atomic.publish_dir(staging, out_dir, replace=True)   # the corpus appears whole or not at all
    finally:
        # a stop (the launcher's signal handler raises) or an error while tokenizing: no half-written
        # corpus stays in the cache; once published, the staging folder is gone already
        shutil.rmtree(staging, ignore_errors=True)
    return done


def _tokenize_into(staging: Path, source, tokenizer, cfg, opts: EncodeOptions, key: str, events) -> dict:
    """Dataset.map's Arrow files written into `staging`; {files (names), bad, n_rows, fingerprint, source}."""
    rows, raw = load_rows(source, cache_dir=staging.parent / "raw", max_row_bytes=cfg.max_row_bytes,
                          max_row_group_bytes=cfg.max_row_group_bytes, max_rows=cfg.max_rows)
    import datasets  # only when tokenizing (pyarrow too): the workers import this module (micro_batches)

    ints = datasets.Sequence(datasets.Value("int32"))
    features = datasets.Features({"row": datasets.Value("int64"), "input_ids": ints, "labels": ints,
                                  "bad": datasets.Value("string"), "truncated": datasets.Value("bool"),
                                  "reasoning_dropped": datasets.Value("int32")})
    if events is not None:
        events.emit("tokenize", f"{source.field}: {len(rows)} rows with {num_proc(cfg.num_proc)} process(es)",
                    step=Path(source.path).name)
    if len(rows) == 0:   # map writes nothing for no rows: an empty corpus file, so the verdict is one clear error
        import pyarrow as pa  # as datasets above

        with pa.OSFile(str(staging / "tokens.arrow"), "wb") as sink, pa.ipc.new_stream(sink, features.arrow_schema):
            pass
        rows = datasets.Dataset.from_file(str(staging / "tokens.arrow"))
    processes = min(num_proc(cfg.num_proc), max(1, len(rows) // 256))
    with inherited_objects_left_alone(processes > 1):
        mapped = rows if len(rows) == 0 else rows.map(
            tokenize_batch, with_indices=True, batched=True, batch_size=256, num_proc=processes,
            remove_columns=rows.column_names, features=features, new_fingerprint=key,
            cache_file_name=str(staging / "tokens.arrow"), fn_kwargs={"tokenizer": tokenizer, "opts": opts, "raw": raw})
    bad = BadRows()
    table = mapped.data.table
    reasons = table.column("bad").to_numpy(zero_copy_only=False)
    row_numbers = table.column("row").to_numpy(zero_copy_only=False)
    for index in np.flatnonzero(reasons != ""):
        bad.add(str(reasons[index]), int(row_numbers[index]))
    bad.truncated = int(np.count_nonzero(table.column("truncated").to_numpy(zero_copy_only=False)))
    bad.reasoning_dropped = int(table.column("reasoning_dropped").to_numpy(zero_copy_only=False).sum())
    files = sorted(Path(f["filename"]).name for f in mapped.cache_files)
    del mapped, table, rows
    for leftover in staging.glob("cache-*"):   # datasets' own temp files: not part of the corpus
        leftover.unlink()
    return {"files": files, "bad": bad.to_dict(), "n_rows": int(len(reasons)), "fingerprint": key,
            "source": source.path}
