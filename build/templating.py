"""Render build/templates/<name> with Jinja2: the Dockerfiles (the image's, for the
classic builder, and the kernel builder's, build/kernels/compile.py) and the gate script.
StrictUndefined makes a missing variable an error instead of empty text, and every value that
reaches a template has already passed the spec's grammars (build/spec/shapes.py)."""
from __future__ import annotations

from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).resolve().parent / "templates"


def render_template(name: str, **variables) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    return env.get_template(name).render(**variables)
