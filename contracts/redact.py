"""Masking secrets in text the tools echo back: an error about a bad URL or reference must not
print the password or token that made it bad, and a server's error answer quoted into a message
must not carry a credential into the log (CI logs are read by many)."""
from __future__ import annotations

import re

MASK = "***"
# user[:password]@ right after a scheme, or at the start of a scheme-less reference
_USERINFO = re.compile(r"(?P<lead>(?:[A-Za-z][A-Za-z0-9+.-]*://)|^)(?P<userinfo>[^/@\s]+)@")
_QUERY = re.compile(r"([?#])[^\s'\"]*")
# well-known token shapes: Hugging Face, GitHub, GitLab, Slack, AWS access keys, generic bearer-like keys
_TOKENS = re.compile(r"\b(?:hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|"
                     r"glpat-[A-Za-z0-9_-]{16,}|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9]{20,})\b")


def carries_credentials(text: str) -> bool:
    """URL user info (`user:password@`) or a token-shaped word: a secret, not merely a bad value."""
    return bool(_USERINFO.search(text) or _TOKENS.search(text))


def mask_url(text: str) -> str:
    """`text` with URL user info, query strings and token-shaped words replaced by ***."""
    text = _USERINFO.sub(lambda m: f"{m.group('lead')}{MASK}@", text)
    text = _QUERY.sub(lambda m: f"{m.group(1)}{MASK}", text)
    return _TOKENS.sub(MASK, text)


# where a quoted answer stops: nothing after a key that names a credential is ever echoed
_SECRET_KEY = re.compile(r"(?i)authori[sz]ation|bearer|basic\s|token|passw|secret|credential|api[-_ ]?key|cookie"
                         r"|session|signature|x-amz|private")
# a JWT (its three parts), or any long opaque string (a key, a token)
_OPAQUE = re.compile(r"eyJ[\w-]*(?:\.[\w-]*){0,2}|[A-Za-z0-9+/_=-]{40,}")


def quote(data: bytes | str, limit: int = 120) -> str:
    """A few words of a server's answer, for an error message: printable, at most `limit`
    characters, cut before any key that names a credential (Authorization, token, password,
    secret...), with JWTs, long opaque strings and known token shapes masked."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = "".join(c if c.isprintable() else "?" for c in " ".join(text[:4 * limit + 512].split()))
    secret = _SECRET_KEY.search(text)
    if secret:
        text = text[:secret.start()] + "[rest withheld]"
    text = mask_url(_OPAQUE.sub(MASK, text))
    return text if len(text) <= limit else text[:limit] + "..."
