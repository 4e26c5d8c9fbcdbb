"""What the build asks of a container engine: the Engine protocol and the values it returns. The
Docker implementation (docker_engine.py) and the tests' fake (tests/fakes/engine.py) both follow it."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from build.errors import BuildFailure
from contracts.events import EventLog


@dataclass(frozen=True)
class BuiltImage:
    id: str
    tag: str
    size_bytes: int
    step_seconds: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    output: str          # stdout and stderr together, in order
    stdout: str = ""     # stdout alone (e.g. a JSON report, free of warnings on stderr)


class ContainerStartFailed(BuildFailure):
    """The container was created but could not start, e.g. its command is not on the image's
    PATH; `explanation` is the engine's own words."""

    def __init__(self, message: str, fix: str = "", explanation: str = ""):
        super().__init__(message, fix)
        self.explanation = explanation

    @property
    def executable_missing(self) -> bool:
        text = self.explanation.lower()
        return "executable file not found" in text or "no such file or directory" in text


class Engine(Protocol):
    def image(self, ref: str) -> dict[str, Any] | None:
        """The image's inspect data, or None if the engine does not have it."""

    def tag(self, image_id: str, ref: str) -> None: ...

    def remove(self, ref: str) -> bool:
        """Remove an image; False when it is not there or still in use (then it is kept)."""

    def load_archive(self, archive: Path, ref: str) -> str:
        """`docker load` a docker-archive (build/oci/docker_archive.py); returns the image ID of `ref`."""

    def load_stream(self, chunks: Iterable[bytes], ref: str) -> str:
        """`docker load` an archive given as byte chunks; returns the image ID of `ref`."""

    def save(self, ref: str, dest: Path) -> None:
        """`docker save` one image into the file `dest`."""

    def history(self, ref: str) -> list[dict[str, Any]]: ...

    def build(self, context: Path, tag: str, labels: dict[str, str], log: EventLog, *,
              expected_steps_seconds: float | None = None) -> BuiltImage:
        """Build with live progress (step N/M, elapsed, ETA)."""

    def run(self, image: str, command: list[str] | None = None, *, network: str = "none",
            volumes: dict[str, dict[str, str]] | None = None, environment: dict[str, str] | None = None,
            user: str | None = None, entrypoint: list[str] | None = None, timeout: float = 3600,
            mem_limit: str | None = None, labels: dict[str, str] | None = None,
            on_output: Callable[[str], None] | None = None, gpus: int | None = None) -> RunResult:
        """Run to completion (output streamed line by line to on_output); the container is removed.
        gpus: pass GPUs through (-1 all, N the first N); a command that cannot start raises
        ContainerStartFailed."""

    def remove_containers(self, label: str) -> int:
        """Remove every container carrying `label` (key=value); returns how many."""

    def read_file(self, image: str, path: str, *, limit: int) -> bytes | None:
        """One regular file from an image, read without running it; None when it is not there or
        is larger than `limit`."""

    def images_with_label(self, label: str) -> list[dict[str, Any]]:
        """Images carrying `label` (key or key=value), newest first."""

    def disk_space(self) -> tuple[str, int] | None:
        """(data-root, free bytes) of the disk the engine keeps images on, or None when that
        disk is not on this host."""
