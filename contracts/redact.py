"""Masking secrets in text the tools echo back: an error about a bad URL or reference must not
print the password or token that made it bad (CI logs are read by many)."""
from __future__ import annotations

import re

MASK = "***"
# user[:password]@ right after a scheme, or at the start of a scheme-less reference
_USERINFO = re.compile(r"(?P<lead>(?:[A-Za-z][A-Za-z0-9+.-]*://)|^)(?P<userinfo>[^/@\s]+)@")
_QUERY = re.compile(r"([?#])[^\s'\"]*")
# well-known token shapes: Hugging Face, GitHub, GitLab, Slack, AWS access keys, generic bearer-like keys
_TOKENS = re.compile(r"\b(?:hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|"
                     r"glpat-[A-Za-z0-9_-]{16,}|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9]{20,})\b")


def mask_url(text: str) -> str:
    """`text` with URL user info, query strings and token-shaped words replaced by ***."""
    text = _USERINFO.sub(lambda m: f"{m.group('lead')}{MASK}@", text)
    text = _QUERY.sub(lambda m: f"{m.group(1)}{MASK}", text)
    return _TOKENS.sub(MASK, text)
