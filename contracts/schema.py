"""The one validation engine: raw YAML/JSON data -> frozen, typed dataclasses, driven by the
dataclasses' own type hints, with every problem collected (file, field, problem, fix).

Supported hints: str, int, float, bool, Any, Literal[...], X | None, tuple[X, ...], list[X],
dict[str, X] and nested dataclasses. Per-field rules live in the field's metadata, built
with `rule(...)`: a regex, a numeric range, a check function, a fix text. Unknown keys get
a did-you-mean. A bad optional field falls back to its default; a bad required field makes
its object invalid (None), and the problem is recorded either way, so one run reports
every problem in a file.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from contracts.numbers import allowed_range, range_problem

MAX_STRING = 64 * 1024   # longer strings are refused: no field of ours needs more


@dataclass(frozen=True)
class Problem:
    file: str      # the file the problem is in, as the user named it
    field: str     # dotted path to the field, e.g. "kernels.flash-attn.source.sdist.sha256"
    problem: str
    fix: str
    code: str = "invalid"  # stable machine-readable kind, e.g. "missing-field", "arch-cuda"

    def render(self) -> str:
        return f"{self.file}: {self.field}: {self.problem}\n    fix: {self.fix}"


class InvalidInput(Exception):
    """Every problem found in some input, reported together."""

    title = "the input"

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} problem(s) in {self.title}")

    SHOWN = 50   # a hostile file can hold 95k bad keys; the first ones say what is wrong

    def render(self) -> str:
        lines = [f"error: {self.title} has {len(self.problems)} problem(s):"]
        lines += [p.render() for p in self.problems[:self.SHOWN]]
        if len(self.problems) > self.SHOWN:
            lines.append(f"... and {len(self.problems) - self.SHOWN} more problem(s) of the same kinds")
        return "\n".join(lines)


class Problems:
    """Collects problems while loaders walk documents, so all are reported at once."""

    def __init__(self) -> None:
        self.items: list[Problem] = []
        self._seen: set[Problem] = set()   # a set, not a list scan: 95k unknown keys must stay linear

    def add(self, file: str, field: str, problem: str, fix: str, code: str = "invalid") -> None:
        item = Problem(str(file), field, problem, fix, code)
        if item not in self._seen:
            self._seen.add(item)
            self.items.append(item)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.items)

    def touches(self, file: str, prefix: str) -> bool:
        """True if a problem was already recorded at or below `prefix` in `file`: a later stage
        uses this to stay quiet about the consequences (no "unknown kernel" after a bad sha256)."""
        return any(p.file == str(file) and (p.field == prefix or p.field.startswith(prefix + ".")
                                            or p.field.startswith(prefix + "["))
                   for p in self.items)

    def raise_if_any(self, error: type[InvalidInput] = InvalidInput) -> None:
        if self.items:
            raise error(list(self.items))


Check = Callable[[Any], "tuple[str, str] | tuple[str, str, str] | None"]


def rule(*, pattern: str | None = None, pattern_fix: str = "", ge: float | None = None, le: float | None = None,
         gt: float | None = None, check: Check | None = None, each: Check | None = None, fix: str = "",
         key: str | None = None, doc: str = "") -> dict[str, Any]:
    """Field metadata for the engine: `field(default=..., metadata=rule(...))`.

    pattern  the whole string must match (re.fullmatch); pattern_fix says how to write it
    ge, le   numeric bounds; gt an exclusive lower bound. Every number is also finite (no nan or
             inf) and every integer fits in 64 bits, bounds or not
    check    f(value) -> None or (problem, fix[, code]) for the whole value
    each     the same, for each item of a tuple/list or each value of a dict
    fix      the fix shown when the field is missing or of the wrong type
    key      the key in the document, when it differs from the field name
    """
    return {"pattern": pattern, "pattern_fix": pattern_fix, "ge": ge, "le": le, "gt": gt, "check": check,
            "each": each, "fix": fix, "key": key, "doc": doc}


class _Invalid:
    def __repr__(self) -> str:
        return "<invalid>"


INVALID = _Invalid()


def short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Reader:
    """Reads one document into dataclasses, recording problems against one file.

    strings_convert: accept "3" for an int, "true" for a bool (command-line overrides).
    string_check: f(path, text) -> None or (problem, fix, code), run on every string value
    and mapping key (e.g. a secret scan over every free-text field).
    """

    def __init__(self, file: str, problems: Problems, *, strings_convert: bool = False,
                 string_check: Callable[[str, str], tuple[str, str, str] | None] | None = None):
        self.file = str(file)
        self.problems = problems
        self.strings_convert = strings_convert
        self.string_check = string_check

    def fail(self, field: str, problem: str, fix: str, code: str = "invalid") -> None:
        self.problems.add(self.file, field, problem, fix, code)

    # -- entry points ---------------------------------------------------------------

    def read(self, kind: type, raw: Any, where: str = "", *, partial: bool = False) -> Any:
        """An instance of dataclass `kind`, or None if `raw` cannot make one (problems recorded).

        partial: build the object even when fields are invalid, with neutral placeholders in
        their place, so later stages can still report their own problems in the same run. Such
        an object is never used for work: its problems are raised before that."""
        if not isinstance(raw, dict):
            self.fail(where or "(file)", f"expected a mapping, got {type(raw).__name__}",
                      "write `key: value` pairs", "wrong-type")
            return None
        self._partial = partial
        try:
            value = self._dataclass(kind, raw, where)
        finally:
            self._partial = False
        return None if value is INVALID else value

    def value(self, hint: Any, raw: Any, where: str, meta: dict | None = None) -> Any:
        """Coerce one value; INVALID (with a recorded problem) when it cannot be."""
        value = self._coerce(hint, raw, where, meta or {})
        if value is not INVALID:
            value = self._apply_rules(value, where, meta or {})
        return value

    # -- the engine -----------------------------------------------------------------

    def _dataclass(self, kind: type, raw: dict, where: str) -> Any:
        hints = typing.get_type_hints(kind)
        known: dict[str, dataclasses.Field] = {}
        for f in dataclasses.fields(kind):
            if f.init:
                known[f.metadata.get("key") or f.name] = f
        for key in raw:
            if key not in known:
                self._unknown_key(key, where, list(known))
        values: dict[str, Any] = {}
        valid = True
        for key, f in known.items():
            path = f"{where}.{key}" if where else str(key)
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if key not in raw or (raw[key] is None and not _allows_none(hints[f.name])):
                if not has_default:
                    fix = f.metadata.get("fix") or f"add `{key}:` to {where or 'the top level'}"
                    self.fail(path, "required field is missing", fix, "missing-field")
                    valid = False
                continue
            value = self.value(hints[f.name], raw[key], path, dict(f.metadata))
            if value is INVALID:
                valid = valid and has_default
                continue
            values[f.name] = value
        if not valid:
            if not getattr(self, "_partial", False):
                return INVALID
            for f in known.values():
                if f.name not in values and f.default is dataclasses.MISSING and \
                        f.default_factory is dataclasses.MISSING:
                    values[f.name] = placeholder(hints[f.name])
        return kind(**values)

    def _unknown_key(self, key: Any, where: str, known: list[str]) -> None:
        path = f"{where}.{key}" if where else str(key)
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        if close:
            fix = f"did you mean `{close[0]}`? (known fields here: {', '.join(sorted(known))})"
        else:
            fix = f"remove it, or use one of: {', '.join(sorted(known))}"
        self.fail(path, "unknown field", fix, "unknown-field")

    def _coerce(self, hint: Any, raw: Any, path: str, meta: dict) -> Any:
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if hint is Any:
            return self._scan_any(raw, path)
        if origin in (typing.Union, types.UnionType):
            if raw is None and type(None) in args:
                return None
            inner = [a for a in args if a is not type(None)]
            return self._coerce(inner[0], raw, path, meta) if len(inner) == 1 else self._scan_any(raw, path)
        if origin is typing.Literal:
            choices = args
            converted = raw
            if self.strings_convert and isinstance(raw, str):
                converted = next((c for c in choices if str(c) == raw), raw)
            if any(converted == c and type(converted) is type(c) for c in choices):
                return converted
            shown = ", ".join(str(c) for c in choices)
            self.fail(path, f"{short(raw)} is not one of: {shown}", f"set {path} to one of: {shown}", "bad-choice")
            return INVALID
        if dataclasses.is_dataclass(hint):
            if not isinstance(raw, dict):
                self._wrong_type(path, raw, "a mapping", meta)
                return INVALID
            return self._dataclass(hint, raw, path)
        if origin in (tuple, list):
            if self.strings_convert and isinstance(raw, str):
                # KEY=[a, b] or KEY=a,b on a command line; items stay text and convert below
                text = raw.strip()
                text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
                raw = [item.strip() for item in text.split(",") if item.strip()]
            if not isinstance(raw, list):
                self._wrong_type(path, raw, "a list", meta)
                return INVALID
            item_hint = args[0] if args else Any
            items = []
            for i, item in enumerate(raw):
                value = self.value(item_hint, item, f"{path}[{i}]", {"each": None})
                if value is not INVALID:
                    value = self._each(value, f"{path}[{i}]", meta)
                if value is not INVALID:
                    items.append(value)
            return tuple(items) if origin is tuple else items
        if origin is dict:
            if not isinstance(raw, dict):
                self._wrong_type(path, raw, "a mapping", meta)
                return INVALID
            value_hint = args[1] if len(args) == 2 else Any
            out = {}
            for key, item in raw.items():
                if not isinstance(key, str):
                    self.fail(f"{path}.{key}", f"keys must be strings, got {short(key)}", 'quote the key: "KEY": ...',
                              "wrong-type")
                    continue
                if self._string_problem(f"{path}.{key}", key):
                    continue
                value = self.value(value_hint, item, f"{path}.{key}")
                if value is not INVALID:
                    value = self._each(value, f"{path}.{key}", meta)
                if value is not INVALID:
                    out[key] = value
            return out
        return self._scalar(hint, raw, path, meta)

    def _scalar(self, hint: type, raw: Any, path: str, meta: dict) -> Any:
        if hint is str:
            if isinstance(raw, (int, float)) and not isinstance(raw, bool):
                if self.strings_convert:
                    return str(raw)
                key = path.rsplit(".", 1)[-1]
                # YAML reads 3.11 and 2.14 as floats; quoting is what people forget
                self.fail(path, f"expected a string, got the number {raw!r}", f'quote it: {key}: "{raw}"', "wrong-type")
                return INVALID
            if not isinstance(raw, str):
                self._wrong_type(path, raw, "a string", meta)
                return INVALID
            return INVALID if self._string_problem(path, raw) else raw
        if hint is bool:
            if isinstance(raw, bool):
                return raw
            words = ("true", "false", "1", "0", "yes", "no")
            if self.strings_convert and isinstance(raw, str) and raw.lower() in words:
                return raw.lower() in ("true", "1", "yes")
            self._wrong_type(path, raw, "true or false", meta)
            return INVALID
        if hint is int:
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            if self.strings_convert and isinstance(raw, str) and re.fullmatch(r"[+-]?\d{1,18}", raw.strip()):
                return int(raw)
            self._wrong_type(path, raw, "an integer", meta)
            return INVALID
        if hint is float:
            try:
                if isinstance(raw, (int, float)) and not isinstance(raw, bool) or \
                        self.strings_convert and isinstance(raw, str):
                    return float(raw)
            except OverflowError:   # an integer past 1.8e308: no more finite than inf
                return self._out_of_range(path, raw, meta, integer=False)
            except ValueError:
                pass
            self._wrong_type(path, raw, "a number", meta)
            return INVALID
        raise TypeError(f"the schema engine does not support {hint!r} (at {path})")

    def _scan_any(self, raw: Any, path: str) -> Any:
        """Free-form data (Any): keep it, but its strings obey the same limits as typed ones."""
        if isinstance(raw, str):
            return INVALID if self._string_problem(path, raw) else raw
        if isinstance(raw, list):
            return [self._scan_any(v, f"{path}[{i}]") for i, v in enumerate(raw)]
        if isinstance(raw, dict):
            return {k: self._scan_any(v, f"{path}.{k}") for k, v in raw.items()}
        return raw

    def _string_problem(self, path: str, text: str) -> bool:
        if len(text) > MAX_STRING:
            self.fail(path, f"a string of {len(text)} characters (limit {MAX_STRING})",
                      "shorten it; no field needs more than 64 KiB", "too-long")
            return True
        if self.string_check:
            found = self.string_check(path, text)
            if found:
                self.fail(path, *found)
                return True
        return False

    def _wrong_type(self, path: str, raw: Any, want: str, meta: dict) -> None:
        key = path.rsplit(".", 1)[-1]
        self.fail(path, f"expected {want}, got {type(raw).__name__} ({short(raw)})",
                  meta.get("fix") or f"make `{key}` {want}", "wrong-type")

    def _each(self, value: Any, path: str, meta: dict) -> Any:
        check = meta.get("each")
        if check is None:
            return value
        return self._verdict(check(value), path, value)

    def _apply_rules(self, value: Any, path: str, meta: dict) -> Any:
        pattern = meta.get("pattern")
        if pattern and isinstance(value, str) and not re.fullmatch(pattern, value):
            self.fail(path, f"{short(value)} is not valid here", meta.get("pattern_fix") or f"match {pattern}",
                      "bad-format")
            return INVALID
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if range_problem(value, meta, integer=isinstance(value, int)):
                return self._out_of_range(path, value, meta, integer=isinstance(value, int))
        check = meta.get("check")
        return self._verdict(check(value), path, value) if check else value

    def _out_of_range(self, path: str, value: Any, meta: dict, *, integer: bool) -> Any:
        self.fail(path, range_problem(value, meta, integer=integer),
                  meta.get("fix") or f"set {path} to {allowed_range(meta, integer=integer)}", "out-of-range")
        return INVALID

    def _verdict(self, found, path: str, value: Any) -> Any:
        if not found:
            return value
        problem, fix, *code = found
        self.fail(path, problem, fix, code[0] if code else "invalid")
        return INVALID


def placeholder(hint: Any) -> Any:
    """A neutral value of a type, standing in for an invalid field in a partial object."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return None if type(None) in args else placeholder(args[0])
    if origin is typing.Literal:
        return args[0]
    if origin in (tuple, list, dict):
        return origin()
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: placeholder(hints[f.name]) for f in dataclasses.fields(hint) if f.init
                       and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})
    return {str: "", int: 0, float: 0.0, bool: False}.get(hint)


def _allows_none(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
