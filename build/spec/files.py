"""Reading one spec file: safe YAML, a problem (not a traceback) for a missing, malformed or
hostile file, and the secret scan every string of a spec goes through."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from contracts import safe_yaml
from contracts.schema import Problems

_SECRET_VALUE = re.compile(r"(hf_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}"
                           r"|glpat-[A-Za-z0-9_-]{20,}|xox[baprs]-[A-Za-z0-9-]{10,}|sk-[A-Za-z0-9]{32,}"
                           r"|-----BEGIN [A-Z ]*PRIVATE KEY)")
_SECRET_KEY = re.compile(r"(password|passwd|secret|token|api[_-]?key|credential|private[_-]?key)", re.I)


def looks_secret(key: str, value: str) -> bool:
    return bool(_SECRET_KEY.search(key) or _SECRET_VALUE.search(value))


def secret_scan(path: str, text: str) -> tuple[str, str, str] | None:
    """Run on every string of a spec: images are public, and so is their build history."""
    if _SECRET_VALUE.search(text):
        return ("looks like it carries a secret (specs end up in image labels and history)",
                "remove the secret; pass credentials at run time, never in the image", "secret")
    return None


def display_path(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when possible."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def read_document(path: Path, problems: Problems, what: str) -> Any:
    """Parse one YAML file; a missing, malformed or hostile file becomes a problem, not a traceback."""
    shown = display_path(path)
    try:
        data = safe_yaml.load_file(path)
    except safe_yaml.YamlRefused as exc:
        problem = f"{what} not found" if exc.code == "missing-file" else exc.problem
        if exc.where and not problem.startswith("malformed YAML"):
            problem += f" (at {exc.where})"
        problems.add(shown, "(file)", problem, exc.fix, exc.code)
        return None
    if not isinstance(data, dict):
        problems.add(shown, "(file)", f"expected a mapping at the top level, got {type(data).__name__}",
                     f"write {what} as `key: value` pairs", "wrong-type")
        return None
    return data


