"""Quoting what a registry said, safely: an error answer's body is echoed into messages (and so
into logs and reports) only as a few printable words, cut before anything that may be a
credential: a key that names one (Authorization, token, password, secret...), a JWT, or any
long opaque string.
"""
from __future__ import annotations

import re

# where a quoted answer stops: nothing after a key that names a credential is ever echoed
SECRET_KEY = re.compile(r"(?i)authori[sz]ation|bearer|basic\s|token|passw|secret|credential|api[-_ ]?key|cookie"
                        r"|session|signature|x-amz|private")
# a JWT (its three parts), or any long opaque string (a key, a token)
OPAQUE = re.compile(r"eyJ[\w-]*(?:\.[\w-]*){0,2}|[A-Za-z0-9+/_=-]{40,}")
LIMIT = 120


def quote(answer, limit: int = LIMIT) -> str:
    """A few words of an error answer's body, for the message: printable, short, and cut before
    anything that may be a credential (a key naming one, a JWT, a long opaque string)."""
    try:
        data = next(answer.iter_content(512), b"")
    except Exception:  # noqa: BLE001 - a body that cannot be read is quoted as nothing
        data = b""
    text = " ".join(data.decode("utf-8", "replace").split())
    text = "".join(c if c.isprintable() else "?" for c in text)
    secret = SECRET_KEY.search(text)
    if secret:
        text = text[:secret.start()] + "[rest withheld]"
    text = OPAQUE.sub("[withheld]", text)
    return text if len(text) <= limit else text[:limit] + "..."
