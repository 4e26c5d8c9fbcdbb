"""The one row reader: a resolved source's rows, as a `datasets.Dataset` for training (load_rows)
or one by one for inspect-data and the tests (read_rows), through the same front door.

JSON lines: every line is read bounded, every bad one a verdict, never a crash. A line that is
not UTF-8, is longer than data.max_row_bytes, does not parse or is not an object becomes a marker
the encoder counts under its reason; no line is ever held in memory whole beyond the limit, and
one bad line never stops the file. Parquet files have each footer checked (row-group sizes)
before any row is read; arrow files and save_to_disk folders are read by `datasets`.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from entrypoint.data.sources import DataError, Source, resolve


@dataclass(frozen=True)
class TooLarge:
    limit: int


def read_raw_lines(path: str, max_row_bytes: int = 8 << 20, progress=None) -> Iterator[str | None | TooLarge]:
    """Each non-blank line of a JSON-lines file as text; None when it is not UTF-8, TooLarge when it
    is over max_row_bytes (the rest of that line is skipped without being kept)."""
    p = Path(path)
    total = p.stat().st_size
    count = 0
    with p.open("rb") as fh:
        while True:
            raw = fh.readline(max_row_bytes + 1)
            if not raw:
                return
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                while (more := fh.readline(1 << 20)) and not more.endswith(b"\n"):
                    pass  # skip the rest of the line without keeping it
                yield TooLarge(max_row_bytes)
            elif raw.strip():
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield None
            else:
                continue
            count += 1
            if progress is not None and count % 256 == 0:
                progress(fh.tell(), total)


def parse_line(raw: str | None | TooLarge) -> object:
    """The row a raw line holds, or a marker the encoder turns into its bad-row reason."""
    if isinstance(raw, TooLarge) or raw is None:
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return raw   # text that is not JSON: counted as invalid_json


def row_problem(row: object) -> str:
    """The reason for a row the front door already knows is bad ("" when it is an object)."""
    if isinstance(row, TooLarge):
        return "row_too_large"
    if row is None:
        return "not_utf8"
    if isinstance(row, str):
        return "invalid_json"
    if not isinstance(row, dict):
        return "not_an_object"
    return ""


def _is_json_array(path: str) -> bool:
    """A .json file holding one array of rows (a .jsonl file is lines, whatever its first line holds)."""
    if Path(path).suffix.lower() == ".jsonl":
        return False
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def check_parquet_footers(files: tuple[str, ...], max_row_group_bytes: int) -> None:
    # pyarrow and datasets only when rows are read: the workers import this module (through tokenize)
    import pyarrow.parquet as pq

    for f in files:
        try:
            meta = pq.ParquetFile(f).metadata
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DataError(f"cannot read parquet {f}: {exc}", "check the file, or set data.format") from None
        for i in range(meta.num_row_groups):
            size = meta.row_group(i).total_byte_size
            if size > max_row_group_bytes:
                raise DataError(f"{f} row group {i} is {size / 2 ** 20:.0f} MiB uncompressed, over "
                                f"data.max_row_group_bytes ({max_row_group_bytes / 2 ** 20:.0f} MiB)",
                                "rewrite the file with smaller row groups (pyarrow row_group_size), or raise "
                                "data.max_row_group_bytes if this host has the memory")


def _json_lines(files: list[str], max_row_bytes: int, max_rows: int):
    """Raw lines for the tokenizer map: the reader's verdict, never a parsed object (a hostile
    row's shape must not decide the dataset's schema)."""
    count = 0
    for path in files:
        for raw in read_raw_lines(path, max_row_bytes):
            if max_rows and count >= max_rows:
                return
            if isinstance(raw, TooLarge):
                yield {"raw": None, "status": "row_too_large"}
            elif raw is None:
                yield {"raw": None, "status": "not_utf8"}
            else:
                yield {"raw": raw, "status": ""}
            count += 1


def load_rows(source: Source, *, cache_dir: Path, max_row_bytes: int, max_row_group_bytes: int,
              max_rows: int = 0):
    """(rows, raw): the source's rows as a Dataset; raw when they are JSON lines as the row reader gave
    them (`raw`/`status` columns), else typed columns."""
    import datasets  # see check_parquet_footers

    datasets.disable_progress_bars()
    try:
        if source.format == "json" and all(_is_json_array(f) for f in source.files):
            # a .json file holding one array of rows: read whole by datasets (there are no lines to bound)
            loaded = datasets.load_dataset("json", data_files={"train": list(source.files)}, split="train",
                                           cache_dir=str(cache_dir))
            return (loaded.select(range(min(max_rows, len(loaded)))) if max_rows else loaded), False
        if source.format == "json":
            features = datasets.Features({"raw": datasets.Value("string"), "status": datasets.Value("string")})
            if next(_json_lines(list(source.files), max_row_bytes, max_rows), None) is None:
                return datasets.Dataset.from_dict({"raw": [], "status": []}, features=features), True   # no rows
            return datasets.Dataset.from_generator(
                _json_lines, features=features, cache_dir=str(cache_dir),
                gen_kwargs={"files": list(source.files), "max_row_bytes": max_row_bytes, "max_rows": max_rows},
                fingerprint=hashlib.sha256(f"{source.identity()}:{max_row_bytes}:{max_rows}".encode()).hexdigest(),
            ), True
        if source.format == "disk":
            loaded = datasets.load_from_disk(source.files[0])
            if isinstance(loaded, datasets.DatasetDict):
                if not source.split:
                    raise DataError(f"{source.field} {source.path} holds several splits "
                                    f"({', '.join(loaded)})", f"set data.split to one of {', '.join(loaded)}",
                                    "data.split")
                if source.split not in loaded:
                    raise DataError(f"{source.field} {source.path} has no split {source.split!r} (it has: "
                                    f"{', '.join(loaded)})", f"set data.split to one of {', '.join(loaded)}",
                                    "data.split")
                loaded = loaded[source.split]
        else:
            if source.format == "parquet":
                check_parquet_footers(source.files, max_row_group_bytes)
            loaded = datasets.load_dataset(source.format, data_files={"train": list(source.files)}, split="train",
                                           cache_dir=str(cache_dir))
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for unreadable files
        raise DataError(f"cannot read {source.field} {source.path} as {source.format}: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                        "check the files, or set data.format to what they are", source.field) from None
    if max_rows:
        loaded = loaded.select(range(min(max_rows, len(loaded))))
    return loaded, False


def read_rows(path: str, fmt: str = "auto", max_rows: int = 0, max_row_bytes: int = 8 << 20,
              progress=None, max_row_group_bytes: int = 1 << 30, split: str = "",
              cache_dir: Path | None = None) -> Iterator[tuple[int, object]]:
    """Yield (row_number, row) from a data source, as training would read it (inspect-data's and
    the tests' in-memory path; training reads the Dataset of load_rows)."""
    source = resolve(path, fmt, split)
    count = 0
    if source.format == "json" and not all(_is_json_array(f) for f in source.files):
        for file in source.files:
            for raw in read_raw_lines(file, max_row_bytes, progress):
                if max_rows and count >= max_rows:
                    return
                yield count, parse_line(raw)
                count += 1
        return
    if source.format == "parquet":
        import pyarrow.parquet as pq  # see check_parquet_footers

        check_parquet_footers(source.files, max_row_group_bytes)
        for file in source.files:
            for batch in pq.ParquetFile(file).iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    if max_rows and count >= max_rows:
                        return
                    yield count, row
                    count += 1
        return
    with tempfile.TemporaryDirectory(prefix="ftimage-rows-") as scratch:
        rows, _ = load_rows(source, cache_dir=cache_dir or Path(scratch), max_row_bytes=max_row_bytes,
                            max_row_group_bytes=max_row_group_bytes, max_rows=max_rows)
        for count, row in enumerate(rows):
            yield count, row
