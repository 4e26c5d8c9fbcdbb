"""`--cache-registry REGISTRY/REPO` and its companions, checked before any build work (exit 2).

What the options mean together:
  * `--cache-key PUB`: entries are read, and used only when their signature verifies with PUB;
  * `--trust-unsigned-cache`: entries are read and used on their own word (logged, and
    recorded in the build report and in the image's lock, `build.remote_cache_trust`);
  * neither: the registry is not read (`--plan` says so);
  * `--sign KEY`: every entry this build made or found locally is pushed, signed (cosign's
    simple-signing format, identity = the cache repository). Without `--sign`, entries are
    pushed unsigned only under `--trust-unsigned-cache`, the team's explicit choice of an
    unsigned cache.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from build.publish.reference import reference_problems
from contracts.schema import InvalidInput, Problem

ENV = "FTIMAGE_CACHE_REGISTRY"
DEFAULT_TIMEOUT = 20.0
MAX_TIMEOUT = 600.0
BUDGET_TIMEOUTS = 30     # the registry time one build may spend in all, in timeouts


class CacheOptionErrors(InvalidInput):
    """--cache-registry or one of its companions is unusable (exit 2)."""
    title = "the --cache-registry options"


@dataclass(frozen=True)
class RemoteCacheOptions:
    registry: str                  # host[:port]
    path: str                      # the repository inside it, e.g. team/ftimage-cache
    timeout: float = DEFAULT_TIMEOUT   # seconds per request, wall clock (a blob: plus 1 s per MiB)
    sign_key: Any = None           # private key: what is pushed is signed with it
    public_key: Any = None         # public key: what is used must verify with it
    trust_unsigned: bool = False   # use (and push) entries without a verified signature

    @property
    def repository(self) -> str:
        return f"{self.registry}/{self.path}"

    @property
    def budget(self) -> float:
        """Seconds the whole build may spend on the registry; then the cache is unavailable."""
        return self.timeout * BUDGET_TIMEOUTS

    @property
    def reads(self) -> bool:
        return self.public_key is not None or self.trust_unsigned

    @property
    def writes(self) -> bool:
        return self.sign_key is not None or self.trust_unsigned

    def describe(self) -> str:
        """One line for `--plan` and the log: what this build does with the registry."""
        from build import signing  # cryptography: the build CLI loads this module on hosts without it

        if self.public_key is not None:
            read = f"read (entries signed by {signing.key_id(self.public_key)[:23]}... only)"
        elif self.trust_unsigned:
            read = "read WITHOUT signature checks (--trust-unsigned-cache)"
        else:
            read = "NOT read (pass --cache-key PUB, or --trust-unsigned-cache)"
        if self.sign_key is not None:
            write = f"written, signed by {signing.key_id(self.sign_key)[:23]}..."
        elif self.trust_unsigned:
            write = "written unsigned"
        else:
            write = "not written (pass --sign KEY)"
        return f"{self.repository}: {read}; {write}; {self.timeout:g}s per request, {self.budget:g}s per build"


def add_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("remote cache (kernels and layers in an OCI registry)")
    group.add_argument("--cache-registry", metavar="REGISTRY/REPO", default=None,
                       help=f"share compiled kernels and assembled layers through this repository "
                            f"(default: ${ENV})")
    trust = group.add_mutually_exclusive_group()
    trust.add_argument("--cache-key", metavar="PUB", type=Path, default=None,
                       help="use only remote cache entries whose signature verifies with this public key")
    trust.add_argument("--trust-unsigned-cache", action="store_true",
                       help="use remote cache entries without a verified signature (logged, and recorded in the "
                            "build report and the image's lock)")
    group.add_argument("--cache-timeout", metavar="SECONDS", type=float, default=DEFAULT_TIMEOUT,
                       help=f"seconds each remote cache request may take in all, wall clock (a blob: plus 1 s "
                            f"per MiB); the whole build spends at most {BUDGET_TIMEOUTS} times this on the "
                            f"registry, then goes on without it (default {DEFAULT_TIMEOUT:g}: "
                            f"{DEFAULT_TIMEOUT * BUDGET_TIMEOUTS:g} s per build)")


def options_from_args(args: argparse.Namespace, *, sign_key=None) -> RemoteCacheOptions | None:
    """The remote cache this command uses, or None; CacheOptionErrors (exit 2) for a bad one.
    `sign_key`: the already loaded `--sign` key, if any."""
    value = args.cache_registry if args.cache_registry is not None else os.environ.get(ENV) or None
    problems: list[Problem] = []
    timeout = args.cache_timeout
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        problems.append(Problem("--cache-timeout", "seconds", f"{timeout!r} is not in (0, {MAX_TIMEOUT:g}]",
                                f"pass a number of seconds, e.g. --cache-timeout {DEFAULT_TIMEOUT:g}"))
    if value is None:
        if args.cache_key is not None or args.trust_unsigned_cache:
            flag = "--cache-key" if args.cache_key is not None else "--trust-unsigned-cache"
            problems.append(Problem(flag, "reference", f"{flag} says how to trust a remote cache, and none is named",
                                    f"add --cache-registry REGISTRY/REPO (or set {ENV})"))
        if problems:
            raise CacheOptionErrors(problems)
        return None
    source = "--cache-registry" if args.cache_registry is not None else ENV
    problems += reference_problems(value, file=source)
    if problems:
        raise CacheOptionErrors(problems)
    from build import signing  # as in describe(): only once a remote cache is named

    public = signing.load_public_key(args.cache_key) if args.cache_key is not None else None
    registry, _, path = value.partition("/")
    return RemoteCacheOptions(registry=registry, path=path, timeout=float(timeout), sign_key=sign_key,
                              public_key=public, trust_unsigned=bool(args.trust_unsigned_cache))
