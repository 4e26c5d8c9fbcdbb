"""A job's inputs, checked before any rank starts: what they are, and that nothing in them asks
to run code the user did not opt into.

* data.path must be a regular file or a folder of them: a FIFO hangs the reader forever, and
  /dev/zero never ends a line.
* model.path (and model.tokenizer): a folder whose config.json or tokenizer_config.json names
  `auto_map` classes would run that folder's Python on load. transformers asks on stdin when
  trust_remote_code is not given; the entrypoint never lets it ask, and refuses such a folder
  unless model.trust_remote_code is true.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from contracts.errors import FixableError

REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
JSON_LIMIT = 16 << 20


class InputError(FixableError):
    def __init__(self, message: str, fix: str, field: str = ""):
        super().__init__(message, fix, field)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_data_path(path: str, field: str = "data.path") -> None:
    """A regular file, or a folder; never a FIFO, device or socket (refused before anything is read)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return   # "does not exist" is reported by the reader, which also knows globs
    except OSError as exc:
        raise InputError(f"{field} {path} cannot be read: {exc.strerror}", f"check {field}", field) from None
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return
    raise InputError(f"{field} {path} is {_kind(st.st_mode)}; training data must be regular files",
                     f"point {field} at a .jsonl/.json/.parquet/.arrow file or a folder of them", field)


def remote_code_requests(folder: Path) -> list[tuple[str, str]]:
    """(file, key) pairs in a model/tokenizer folder that would make transformers import the
    folder's own Python: `auto_map` in its configs."""
    found = []
    for name in REMOTE_CODE_FILES:
        path = folder / name
        try:
            if not path.is_file() or path.stat().st_size > JSON_LIMIT:
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue   # unreadable configs are reported by the loader
        if isinstance(data, dict) and data.get("auto_map"):
            found.append((str(path), "auto_map"))
    return found


def check_remote_code(paths: list[str], trust_remote_code: bool) -> None:
    if trust_remote_code:
        return
    for text in dict.fromkeys(p for p in paths if p):
        folder = Path(text)
        if not folder.is_dir():
            continue
        requests = remote_code_requests(folder)
        if requests:
            file, key = requests[0]
            raise InputError(f"{file} sets `{key}`: loading it would run Python code from {folder}",
                             "review that code, then set model.trust_remote_code=true to allow it; or use a model "
                             "folder without auto_map (Qwen3.5 is native in transformers)", "model.trust_remote_code")
