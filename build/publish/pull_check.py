"""`--check-pull containerd[=SOCKET]`: after `--push`, pull the pushed digest with containerd.

A registry stores a manifest after checking little more than that its blobs exist; containerd, the
runtime under Kubernetes nodes (CRI), checks much more when it pulls and unpacks: that the manifest
lists as many layers as the config's rootfs has diff_ids, that each layer unpacks to its diff_id.
A manifest the registry took and containerd refuses would surface only as a pod that never
starts. So, asked for it, the push pulls what it pushed through containerd's own client (`ctr`,
in a namespace of its own; the image is removed again) and fails with containerd's words (exit 1)
before the push is recorded or signed.

The check is explicit: a host without `ctr` or the socket is refused before any build work (exit
2). It pulls anonymously (`ctr` reads no `docker login`): a registry that wants a login is
checked by pulling on a node that has one.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass

from build.errors import BuildFailure
from build.publish.registry import _plain_http, engine_allows_plain_http
from contracts.events import EventLog
from contracts.schema import InvalidInput, Problem

RUNTIMES = ("containerd",)
DEFAULT_SOCKET = "/run/containerd/containerd.sock"   # dockerd's own containerd: /run/docker/containerd/containerd.sock
NAMESPACE = "ftimage-pull-check"
TIMEOUT = 3600          # seconds for the whole pull: it downloads and unpacks every layer


class PullCheckErrors(InvalidInput):
    """A --check-pull this host cannot run (exit 2, before any build work)."""
    title = "--check-pull"


@dataclass(frozen=True)
class PullCheck:
    runtime: str        # containerd
    address: str        # its socket


def pull_check_from_args(value: str | None, *, push: bool) -> PullCheck | None:
    """The CLI's --check-pull, checked before any build work: a runtime this module knows, with
    `--push`, and its client and socket present on this host."""
    if value is None:
        return None
    runtime, _, address = value.partition("=")
    address = address or DEFAULT_SOCKET
    fix_form = "--check-pull containerd, or --check-pull containerd=SOCKET"
    problems = []
    if not push:
        problems.append(Problem("--check-pull", "runtime", "checks what --push pushed, and there is no --push",
                                "add --push REGISTRY/REPO, or drop --check-pull"))
    if runtime not in RUNTIMES:
        problems.append(Problem("--check-pull", "runtime", f"{runtime[:40]!r} is not a runtime it can pull with",
                                fix_form))
    elif shutil.which("ctr") is None:
        problems.append(Problem("--check-pull", "runtime", "containerd's client `ctr` is not on PATH",
                                "install containerd's client (Debian: containerd), or drop --check-pull"))
    elif not _is_socket(address):
        problems.append(Problem("--check-pull", "socket", f"{address[:200]!r} is not a socket here",
                                "name containerd's socket: --check-pull containerd=SOCKET (dockerd's own: "
                                "/run/docker/containerd/containerd.sock)"))
    if problems:
        raise PullCheckErrors(problems)
    return PullCheck(runtime, address)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def check_pull(check: PullCheck, registry: str, reference: str, *, log: EventLog, timeout: float = TIMEOUT) -> None:
    """Pull `reference` (REGISTRY/REPO@sha256:...) with containerd and remove it again; a refusal
    is BuildFailure with containerd's own reason on one line. Plain HTTP where the push spoke it:
    loopback, or a registry the engine lists in `insecure-registries`."""
    plain_http = _plain_http(registry) or engine_allows_plain_http(registry)
    ctr = ["ctr", "--address", check.address, "--namespace", NAMESPACE]
    log.emit("push", f"pulling {reference} with containerd ({check.address}) to check it")
    argv = [*ctr, "images", "pull", *(["--plain-http"] if plain_http else []), reference]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BuildFailure(f"containerd did not pull {reference} within {timeout:g} s",
                           "check the network between this host and the registry, then push again") from None
    except OSError as exc:
        raise BuildFailure(f"could not run containerd's client to pull {reference}: {exc}",
                           "install containerd's client (ctr), or drop --check-pull") from None
    finally:
        _remove(ctr, reference)
    if done.returncode != 0:
        raise BuildFailure(f"containerd refused to pull {reference}: {containerd_reason(done.stderr)}",
                           "the registry holds an image that containerd (Kubernetes nodes) will not run: build "
                           f"and push again; `ctr images pull {reference}` shows the same")
    log.emit("push", f"containerd pulled and unpacked {reference}")


def _remove(ctr: list[str], reference: str) -> None:
    """Leave nothing of the check in containerd (its content goes at containerd's next collection)."""
    try:
        subprocess.run([*ctr, "images", "rm", reference], capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        pass


def containerd_reason(stderr: str) -> str:
    """containerd's own error from ctr's output: its `ctr: ...` line (the last), else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    reasons = [line.removeprefix("ctr: ") for line in lines if line.startswith("ctr: ")]
    reason = (reasons or lines or ["no reason given"])[-1]
    return " ".join(reason.split())[:400]
