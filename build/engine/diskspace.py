"""Room on the engine's disk for an image build, checked before a multi-GB build starts.

A build of an image with CUDA torch holds, at its peak, the uploaded context (the wheels),
the builder stage (a COPY of the wheels plus the venv they unpack into, about twice their
size) and the runtime stage (a copy of that venv). Measured on images/kernel-smoke: 3.0 GB of
wheels, 17 GB at the peak. A disk that fills mid-build fails after minutes with pip's
"No space left on device"; this check fails in a second instead, after first pruning what
this tool itself left behind.
"""
from __future__ import annotations

from collections.abc import Callable

from build.engine.interface import Engine
from build.errors import BuildFailure
from contracts.events import EventLog

PEAK_PER_WHEEL_BYTE = 6     # context + COPY layer + venv (~2x) in the builder + venv (~2x) in the runtime
FINAL_PER_WHEEL_BYTE = 2    # the runtime image alone: below this the build cannot fit at all

DISK_FIX = ("free space on the disk that holds Docker's data-root ({root}): remove images you no longer need "
            "(`docker image ls`, `docker image rm`, `docker image prune`), or move the data-root to a larger disk "
            "(`data-root` in /etc/docker/daemon.json)")


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def make_room(engine: Engine, *, image: str, wheel_bytes: int, free_layer_cache: Callable[[], list[str]],
              log: EventLog) -> list[str]:
    """Fail early when the build cannot fit; prune this image's builder-stage layer cache when
    it would not otherwise fit. Returns what was pruned. An engine whose disk is not on this
    host (a remote DOCKER_HOST) is not checked."""
    space = engine.disk_space()
    if space is None:
        return []
    root, free = space
    peak, final = wheel_bytes * PEAK_PER_WHEEL_BYTE, wheel_bytes * FINAL_PER_WHEEL_BYTE
    pruned: list[str] = []
    if free < peak:
        pruned = free_layer_cache()
        if pruned:
            root, free = engine.disk_space() or (root, free)
            log.emit("image", f"{gib(free)} free on the engine's disk after dropping this image's layer cache "
                              f"({', '.join(pruned)})")
    if free < final:
        raise BuildFailure(f"not enough disk for {image}: {gib(free)} free at {root}, and the image alone needs "
                           f"about {gib(final)} (about {gib(peak)} while it builds)", DISK_FIX.format(root=root))
    if free < peak:
        log.emit("image", f"warning: {gib(free)} free at {root}; building {image} may need up to {gib(peak)} "
                          "(cached steps need less)")
    return pruned
