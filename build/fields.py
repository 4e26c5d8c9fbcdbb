"""Typed field access over parsed YAML that records problems instead of raising.

Loaders call these while walking a document; a bad field yields None (or a default)
and one recorded problem, so a single run reports every problem in the file.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from build.errors import Problems

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_MISSING = object()


class Fields:
    """Reads fields of one YAML file, recording problems against that file."""

    def __init__(self, file: str | Path, problems: Problems):
        self.file = str(file)
        self.problems = problems

    def fail(self, field: str, problem: str, fix: str, code: str = "invalid") -> None:
        self.problems.add(self.file, field, problem, fix, code)

    def get(self, data: Any, key: str, field: str, kind: type | tuple[type, ...], *, required: bool = True,
            default: Any = None, fix: str = "") -> Any:
        path = f"{field}.{key}" if field else key
        if not isinstance(data, dict):
            return default
        value = data.get(key, _MISSING)
        if value is _MISSING or value is None:
            if required:
                self.fail(path, "required field is missing", fix or f"add `{key}:` to {field or 'the top level'}",
                          "missing-field")
            return default
        if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            # YAML reads 3.11 and 2.14 as floats; quoting is what users forget.
            self.fail(path, f"expected a string, got the number {value!r}", f'quote it: {key}: "{value}"',
                      "wrong-type")
            return default
        if not isinstance(value, kind):
            want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            self.fail(path, f"expected {want}, got {type(value).__name__} ({_short(value)})",
                      fix or f"make `{key}` a {want}", "wrong-type")
            return default
        return value

    def str_list(self, data: Any, key: str, field: str, *, required: bool = True) -> tuple[str, ...]:
        values = self.get(data, key, field, list, required=required, default=[])
        path = f"{field}.{key}" if field else key
        out = []
        for i, item in enumerate(values):
            if not isinstance(item, str):
                self.fail(f"{path}[{i}]", f"expected a string, got {_short(item)}", "quote the entry",
                          "wrong-type")
            else:
                out.append(item)
        return tuple(out)

    def str_map(self, data: Any, key: str, field: str) -> dict[str, str]:
        values = self.get(data, key, field, dict, required=False, default={})
        path = f"{field}.{key}" if field else key
        out = {}
        for k, v in values.items():
            if not isinstance(k, str) or not isinstance(v, (str, int)) or isinstance(v, bool):
                self.fail(f"{path}.{k}", f"expected a string value, got {_short(v)}", 'quote it: KEY: "VALUE"',
                          "wrong-type")
            else:
                out[k] = str(v)
        return out

    def sha256(self, data: Any, key: str, field: str) -> str | None:
        value = self.get(data, key, field, str, fix="add the sha256 of the exact file (`sha256sum FILE`)")
        if value is None:
            return None
        if not SHA256_RE.match(value):
            self.fail(f"{field}.{key}", f"not a sha256 (64 lowercase hex characters): {_short(value)} "
                      f"has {len(value)} characters", "paste the full digest from `sha256sum FILE`", "bad-sha256")
            return None
        return value

    def unknown_keys(self, data: Any, field: str, allowed: set[str]) -> None:
        if not isinstance(data, dict):
            return
        for key in data:
            if key not in allowed:
                path = f"{field}.{key}" if field else str(key)
                self.fail(path, "unknown field", f"remove it, or use one of: {', '.join(sorted(allowed))}",
                          "unknown-field")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_yaml(path: Path, problems: Problems, what: str) -> Any:
    """Parse one YAML file; a missing or malformed file becomes a problem, not a traceback."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        problems.add(path, "(file)", f"{what} not found", f"create {path} or check the path", "missing-file")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.add(path, "(file)", f"cannot read {what}: {exc}", "check the file's permissions and encoding",
                     "unreadable")
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        problems.add(path, "(file)", f"malformed YAML{where}: {reason}",
                     "fix the YAML syntax (indentation, a missing ':' or an unclosed quote)", "malformed-yaml")
        return None
    if not isinstance(data, dict):
        problems.add(path, "(file)", f"expected a mapping at the top level, got {type(data).__name__}",
                     f"write {what} as `key: value` pairs", "wrong-type")
        return None
    return data


def display_path(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when possible."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
