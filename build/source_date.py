"""SOURCE_DATE_EPOCH: the one build time every layer, base and lock is capped by, read as the
reproducible-builds spec defines it, or HEAD's commit time when unset."""
from __future__ import annotations

import os
import subprocess

from build.spec import REPO_ROOT
from contracts.schema import InvalidInput, Problem, short

MAX_EPOCH = 2 ** 32   # 2106: a sane timestamp; a larger one overflows tar headers and datetime


class BadEpoch(InvalidInput):
    title = "the environment"


def parse_epoch(text: str) -> int:
    """SOURCE_DATE_EPOCH as the reproducible-builds spec defines it: ASCII digits only (`isdigit`
    also accepts '²', which int() refuses), within 0..2^32. Anything else is exit 2, never a
    silent fallback to another time."""
    if not text or len(text) > 10 or not all("0" <= c <= "9" for c in text) or int(text) > MAX_EPOCH:
        raise BadEpoch([Problem("environment", "SOURCE_DATE_EPOCH", f"{short(text)} is not a Unix time in seconds "
                                f"(ASCII digits, 0..{MAX_EPOCH})",
                                "unset it (the build uses HEAD's commit time), or set it to e.g. "
                                "$(git log -1 --format=%ct)", "bad-epoch")])
    return int(text)


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH if set; else the commit time of HEAD, so a checkout renders reproducibly."""
    env = os.environ.get("SOURCE_DATE_EPOCH")
    if env is not None:
        return parse_epoch(env)
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%ct"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return int(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return 0
