"""The registry reference grammar: what `--push REGISTRY/REPO`, `--cache-registry` and `audit`
accept as a repository, each problem named with its fix (exit 2, before any build work).

A reference names a registry and a repository and nothing else: the tag is the image's own
(`<name>:<plan key>` locally, so the pushed tag says which plan built it), and a digest names
content that exists already, which a push creates. Here, apart from the push itself, so that the
remote cache and the audit can read references without importing what pushes an image.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from build.build_report import REPORT_NAME
from build.spec.shapes import IMAGE_REF, SHA256
from contracts.redact import carries_credentials, mask_url
from contracts.schema import InvalidInput, Problem

if TYPE_CHECKING:
    from build.publish.pull_check import PullCheck

# Docker's reference grammar (distribution/reference), split so each part can be named in an error.
PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
REGISTRY = rf"(?:{HOST_LABEL}(?:\.{HOST_LABEL})*|\[[0-9A-Fa-f:]+\])(?::(?P<port>[0-9]{{1,5}}))?"
DIGEST = rf"sha256:{SHA256}"
REFERENCE_CHARS = re.compile(r"[A-Za-z0-9._:/@\[\]-]")
MAX_NAME_LENGTH = 255            # distribution's limit on REGISTRY/PATH
EXAMPLE = "registry.example.com:5000/team/qwen27b"


class PushReferenceErrors(InvalidInput):
    """The --push value is not a registry repository we can push to (exit code 2)."""
    title = "the --push reference"


@dataclass(frozen=True)
class PushTarget:
    registry: str        # host[:port], as dockerd will dial it
    path: str            # the repository inside the registry, e.g. team/qwen27b
    pull_check: PullCheck | None = None   # --check-pull: pull what was pushed with this runtime first

    @property
    def repository(self) -> str:
        return f"{self.registry}/{self.path}"


def reference_problems(value: str, *, file: str = "--push", field: str = "") -> list[Problem]:
    """Every problem with `value` as a push target, each naming the part and its fix.
    `file` says where the value came from (the flag, or a report); `field`, if given, is the
    field every problem is filed under instead of the part of the reference."""
    problems: list[Problem] = []

    def add(part: str, problem: str, fix: str) -> None:
        problems.append(Problem(file, field or part, problem, fix))

    if not value.strip():
        add("reference", "is empty", f"name a registry and a repository, e.g. --push {EXAMPLE}")
        return problems
    if carries_credentials(value):
        add("reference", f"{mask_url(value)[:120]!r} carries credentials or a token", "never put credentials in a "
            "reference: `docker login REGISTRY` (or the engine's credential helper) supplies them at push time")
        return problems
    if mask_url(value) != value:   # a query or fragment: malformed, and what follows it is masked all the same
        marks = " and ".join(repr(c) for c in "?#" if c in value)
        add("reference", f"{mask_url(value)[:120]!r} has a query or fragment ({marks}), which no Docker reference "
            "holds", f"drop everything from {marks}: write REGISTRY/REPO, e.g. {EXAMPLE}")
        return problems
    bad = sorted({c for c in value if not REFERENCE_CHARS.fullmatch(c)})
    if bad:
        add("reference", f"{value[:120]!r} has characters no Docker reference holds: "
            f"{', '.join(repr(c) for c in bad)}", f"use only letters, digits and . _ - : / e.g. {EXAMPLE}")
        return problems
    rest = value
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", rest)
    if scheme:
        rest = rest[scheme.end():]
        add("registry", f"{value!r} starts with a URL scheme ({scheme.group(1)}://); a Docker reference has none",
            f"drop '{scheme.group(0)}': dockerd chooses HTTPS itself (a plain-HTTP registry other than "
            "127.0.0.1/localhost goes into dockerd's insecure-registries)")
    name, at, digest = rest.partition("@")
    tagged = "/" in name and ":" in name.rpartition("/")[2]   # before the first '/', a ':' is a port
    if at and tagged:
        add("reference", f"{value!r} has a tag AND a digest", "drop both: the build tags the image with its "
            "plan key and the registry returns the digest, which the build report records")
    elif at:
        add("digest", f"'@{digest}' is a digest: it names content already in a registry, and a push creates it",
            f"drop '@{digest[:20]}...': the digest is recorded in {REPORT_NAME} after the push")
    elif tagged:
        add("tag", f"{value!r} carries a tag ({name.rpartition(':')[2]!r}); the build chooses the tag "
            "(the image's plan key, so the tag says which plan built it)", f"drop it: --push {name.rpartition(':')[0]}")
    if tagged:
        name = name.rpartition(":")[0]
    parts = name.split("/")
    if any(not part for part in parts):
        add("repository", f"{name!r} has an empty part (a leading, trailing or doubled '/')",
            f"write REGISTRY/REPO with no empty parts, e.g. {EXAMPLE}")
        return problems
    registry = parts[0]
    looks_like_host = "." in registry or ":" in registry or registry == "localhost" or "[" in registry
    if len(parts) < 2 and looks_like_host:
        add("repository", f"{name!r} names a registry but no repository in it",
            f"add the repository path: --push {name}/team/{EXAMPLE.rpartition('/')[2]}")
        return problems
    if len(parts) < 2 or not looks_like_host:
        add("registry", f"{name!r} names no registry, so Docker would push it to Docker Hub",
            f"write REGISTRY/REPO, e.g. {EXAMPLE} (docker.io/team/qwen27b for Docker Hub, explicitly)")
        return problems
    host = re.fullmatch(REGISTRY, registry)
    if host is None:
        add("registry", f"{registry!r} is not a registry host[:port]", "write the host name or IP address, "
            "optionally with :PORT, e.g. registry.example.com:5000 or 127.0.0.1:5000")
    elif host.group("port") and not 0 < int(host.group("port")) < 65536:
        add("registry", f"port {host.group('port')} is out of range", "use a TCP port in 1..65535")
    path = "/".join(parts[1:])
    if path != path.lower():
        add("repository", f"{path!r} has uppercase letters; Docker repository paths are lowercase",
            f"write --push {registry}/{path.lower()}")
    else:
        for component in parts[1:]:
            if not re.fullmatch(PATH_COMPONENT, component):
                add("repository", f"{component!r} is not a Docker repository path component",
                    "use lowercase letters and digits, separated by '.', '_', '__' or '-' (not at either end)")
    if len(name) > MAX_NAME_LENGTH:
        add("repository", f"the name is {len(name)} characters long", f"keep REGISTRY/REPO within "
            f"{MAX_NAME_LENGTH} characters")
    if not problems and not re.fullmatch(IMAGE_REF, name):  # the spec's own grammar agrees (belt and braces)
        add("reference", f"{name!r} is not a Docker reference", f"write REGISTRY/REPO, e.g. {EXAMPLE}")
    return problems


def parse_push_target(value: str, *, file: str = "--push", field: str = "") -> PushTarget:
    problems = reference_problems(value, file=file, field=field)
    if problems:
        raise PushReferenceErrors(problems)
    registry, _, path = value.partition("/")
    return PushTarget(registry=registry, path=path)


def push_target_from_args(value: str | None, modes: dict[str, bool]) -> PushTarget | None:
    """The CLI's --push, checked before any build work. `modes` are the other flags that stop
    before an image exists (a push needs one) or read an earlier push instead of making one."""
    if value is None:
        return None
    clashing = [flag for flag, given in modes.items() if given]
    if clashing:
        raise PushReferenceErrors([Problem("--push", "reference", f"--push needs a built image, and {clashing[0]} "
                                           "builds none", f"leave out {clashing[0]}: python -m build IMAGE_DIR "
                                           "--push REGISTRY/REPO builds, then pushes")])
    return parse_push_target(value)
