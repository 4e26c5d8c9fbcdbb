"""YAML loading that refuses hostile documents by construction, not by timing.

Specs, manifests and finetune configs come from users. Refused outright:
  * files over 1 MiB, and any single string over 64 KiB;
  * anchors and aliases (&a / *a): an alias bomb expands a few lines into gigabytes;
  * nesting deeper than 64 levels;
  * duplicate keys, which PyYAML would otherwise resolve silently to the last one;
  * anything but the safe scalar, list and mapping types (yaml.SafeLoader's rules).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from contracts.errors import FixableError

MAX_FILE_BYTES = 1 << 20
MAX_STRING = 64 * 1024
MAX_DEPTH = 64


class YamlRefused(FixableError):
    """Why a document was not loaded; `where` is "line L, column C" when known."""

    def __init__(self, problem: str, fix: str, code: str, where: str = ""):
        super().__init__(problem, fix)
        self.problem, self.code, self.where = problem, code, where


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


# libyaml's parser when PyYAML has it (about 20x faster on a hostile 1 MiB file); the rules are
# checked on its event stream first, then the same loader constructs the data.
_BASE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_events(text: str) -> None:
    """Anchors/aliases, string sizes and depth, from the event stream (no node is built yet)."""
    depth = 0
    for event in yaml.parse(text, Loader=_BASE):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise YamlRefused("YAML anchors and aliases (&name, *name) are not accepted",
                              "write each value out in full", "yaml-alias", _where(event.start_mark))
        if isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_STRING:
            raise YamlRefused(f"a string of {len(event.value)} characters (limit {MAX_STRING})",
                              "shorten it; no field needs more than 64 KiB", "too-long", _where(event.start_mark))
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels", "flatten the document",
                                  "too-deep", _where(event.start_mark))
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


class _StrictLoader(_BASE):
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable key: let SafeLoader raise its own error
                continue
            if duplicate:
                raise YamlRefused(f"key {key!r} appears twice in one mapping",
                                  "keep one; YAML would silently use the last", "duplicate-key",
                                  _where(key_node.start_mark))
        return super().construct_mapping(node, deep)


def loads(text: str) -> Any:
    """Parse a YAML string under the rules above; raises YamlRefused."""
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_FILE_BYTES:
        raise YamlRefused(f"the document is over {MAX_FILE_BYTES >> 20} MiB", "a spec or config is a few KiB; "
                          "check that this is the right file", "too-large")
    try:
        _check_events(text)
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except YamlRefused:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        at = f" at {_where(mark)}" if mark is not None else ""
        raise YamlRefused(f"malformed YAML{at}: {reason}", "fix the YAML syntax (indentation, a missing ':' or an "
                          "unclosed quote)", "malformed-yaml", _where(mark)) from None
    except RecursionError:
        raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels", "flatten the document", "too-deep") from None


def load_file(path: Path) -> Any:
    """Read and parse a file; a missing, oversized, unreadable or hostile file raises YamlRefused."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise YamlRefused("file not found", f"create {path} or check the path", "missing-file") from None
    except OSError as exc:
        raise YamlRefused(f"cannot read: {exc.strerror}", "check the path and its permissions", "unreadable") from None
    if not path.is_file():
        raise YamlRefused("not a regular file", "point at a YAML file", "unreadable")
    if size > MAX_FILE_BYTES:
        raise YamlRefused(f"the file is {size} bytes, over the {MAX_FILE_BYTES >> 20} MiB limit",
                          "a spec or config is a few KiB; check that this is the right file", "too-large")
    try:
        text = path.read_bytes()[: MAX_FILE_BYTES + 1].decode("utf-8")
    except UnicodeDecodeError:
        raise YamlRefused("not UTF-8 text", "save the file as UTF-8", "unreadable") from None
    except OSError as exc:
        raise YamlRefused(f"cannot read: {exc.strerror}", "check the file's permissions", "unreadable") from None
    return loads(text)
