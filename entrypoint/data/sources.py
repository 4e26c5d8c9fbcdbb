"""Where rows come from: a data source (data.path, or one entry of data.sources) resolved to its
files, offline. Reading them is rows.py's job.

data.path may be a file (.jsonl, .json, .parquet, .arrow), a folder of them, a glob, a
`save_to_disk` folder, or a local dataset folder read as one split (`data.split`), its splits
resolved as `datasets` resolves them (dataset_folder.py: the README's `configs:`, then datasets'
own patterns; ultrachat_200k's `data/train_sft-00000-of-00003-<hash>.parquet` shards are its
`train_sft` split). Everything is refused with the field and the fix before any rank starts:
nothing there, mixed formats, a split the dataset does not have, a path leaving the folder,
something that is not a regular file.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import FixableError
from entrypoint.data.dataset_folder import FolderRefused, split_files, splits
from entrypoint.data.linked_files import LinkRefused, glob_files, walk
from entrypoint.inputs import InputError, check_data_path

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
FORMATS = ("auto", "jsonl", "json", "parquet", "arrow", "disk")
DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class DataError(FixableError):
    """The data source as a whole is unusable (missing file, unreadable format)."""

    fix_in_str = True

    def __init__(self, message: str, fix: str, field: str = "data.path"):
        super().__init__(message, fix, field)


@dataclass(frozen=True)
class Source:
    """One resolved source: its files (or a save_to_disk folder) and how to read its rows."""

    field: str                 # the config field it came from, for messages ("data.path", "data.sources[1].path")
    path: str
    format: str                # json | parquet | arrow | disk
    files: tuple[str, ...]     # the data files (for disk: the folder)
    split: str = ""

    def identity(self) -> str:
        """A content key: every file's size and sha256 (so a rerun hits the cache and any edit misses)."""
        h = hashlib.sha256(json.dumps([self.format, self.split]).encode())
        paths = self.files if self.format != "disk" else sorted(
            str(p) for p in Path(self.files[0]).rglob("*") if p.is_file())
        for path in paths:
            h.update(path.encode())
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
        return h.hexdigest()


def _kind_of(path: str, declared: str) -> str:
    if declared in ("jsonl", "json"):
        return "json"
    if declared in ("parquet", "arrow"):
        return declared
    kind = SUFFIXES.get(Path(path).suffix.lower())
    if kind is None:
        raise DataError(f"cannot tell the format of {path} from its name",
                        "name data files .jsonl/.json/.parquet/.arrow, or set data.format")
    return kind


def _split_field(field: str) -> str:
    return field.removesuffix(".path") + ".split" if field.endswith(".path") else "data.split"


def _split_files(path: str, fmt: str, split: str, field: str) -> list[str]:
    """The files of one split of the dataset folder `path` (DataError naming the real splits)."""
    split_field = _split_field(field)
    try:
        declared = splits(path, field)
        if split not in declared:
            have = ", ".join(declared)
            raise DataError(f"{split_field} {split!r}: {path} has no such split" + (f" (it has: {have})" if have
                            else " (it holds no data files)"), f"set {split_field} to one of: {have}, or leave it "
                            "empty to read every file" if have else f"point {field} at the dataset folder", split_field)
        files = [f for f in split_files(path, split, declared[split])
                 if fmt != "auto" or Path(f).suffix.lower() in SUFFIXES]
    except FolderRefused as exc:
        raise DataError(str(exc), exc.fix, field) from None
    if not files:
        raise DataError(f"{split_field} {split!r} of {path} has no .jsonl/.json/.parquet/.arrow file",
                        "convert that split to one of those formats, or set data.format", split_field)
    return files


def resolve(path: str, fmt: str = "auto", split: str = "", field: str = "data.path") -> Source:
    """Resolve a source's files (DataError / InputError with the field and a fix). Every form obeys
    linked_files' rule: no file is reached through a link that leaves the path the field names."""
    try:
        return _resolve(path, fmt, split, field)
    except LinkRefused as exc:
        raise DataError(exc.message, exc.fix, field) from None


def _resolve(path: str, fmt: str, split: str, field: str) -> Source:
    if not path:
        raise DataError(f"{field} is not set", "set it to a data file, folder or glob", field)
    has_glob = any(c in path for c in "*?[")
    if has_glob:
        files = glob_files(path, f"{field} {path}")
        if not files:
            raise DataError(f"{field} {path} matches no file", "check the pattern (quote it in a shell)", field)
    elif not os.path.exists(path):
        raise DataError(f"data file {path} does not exist", "mount the data and set data.path (a file, a folder "
                        "of .jsonl/.json/.parquet/.arrow files, a glob, or a save_to_disk folder)", field)
    else:
        check_data_path(path, field)
        if os.path.isfile(path):
            if fmt == "disk":
                raise DataError(f"{field} {path} is a file, data.format=disk needs a save_to_disk folder",
                                "point it at the folder, or set data.format=auto", field)
            files = [path]
        elif fmt == "disk" or any((Path(path) / m).is_file() for m in DISK_MARKERS):
            walk(path, f"{field} {path}")       # datasets reads every file under it: none through a link out
            return Source(field, path, "disk", (path,), split)   # its own splits: rows.py reads them
        elif split:
            files = _split_files(path, fmt, split, field)
        else:
            files = [f for f in walk(path, f"{field} {path}")
                     if os.path.isfile(f) and (Path(f).suffix.lower() in SUFFIXES or fmt not in ("auto", "disk"))]
            if not files:
                raise DataError(f"{field} {path} is a folder with no .jsonl/.json/.parquet/.arrow file",
                                "point it at the folder that holds the data files, or at one file", field)
    if split and (has_glob or os.path.isfile(path)):
        split_field = _split_field(field)
        raise DataError(f"{split_field} {split!r} selects a split of a dataset folder, and {field} {path} is "
                        f"{'a glob' if has_glob else 'a file'}", f"point {field} at the dataset folder, or leave "
                        f"{split_field} empty", split_field)
    for f in files:
        check_data_path(f, field)
    kinds = {_kind_of(f, fmt) for f in files}
    if len(kinds) > 1:
        raise DataError(f"{field} {path} mixes formats ({', '.join(sorted(kinds))}) in one source",
                        "keep one format per source; list the others as separate data.sources entries", field)
    return Source(field, path, kinds.pop(), tuple(files), split)


__all__ = ["DataError", "FORMATS", "InputError", "Source", "resolve"]
