"""The Docker engine, through the docker SDK: build, run, inspect, import, tag and remove.

The SDK speaks only the classic builder (no BuildKit: docker/docker-py #2230), so our
Dockerfiles use no `RUN --mount` and every RUN step runs with networking disabled.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import docker
import docker.errors
import requests.exceptions

from build.errors import BuildFailure
from build.log import EventLog

_STEP_RE = re.compile(r"^Step (\d+)/(\d+) : (.*)$")

ENGINE_FIX = ("start a Docker engine: `apt-get install -y docker.io` then `dockerd &` "
              "(or `systemctl start docker`); set DOCKER_HOST if it listens elsewhere")


@dataclass(frozen=True)
class BuiltImage:
    id: str
    tag: str
    size_bytes: int
    step_seconds: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    output: str


class Engine:
    def __init__(self, client: docker.DockerClient):
        self.client = client

    @classmethod
    def connect(cls, timeout: int = 600) -> "Engine":
        try:
            client = docker.from_env(timeout=timeout)
            client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            reason = str(exc).split("(Caused by")[0].strip()
            raise BuildFailure(f"cannot reach the Docker engine: {reason}", ENGINE_FIX) from None
        return cls(client)

    # -- images ---------------------------------------------------------------------

    def image(self, ref: str) -> dict[str, Any] | None:
        """The image's inspect data, or None if the engine does not have it."""
        try:
            return self.client.api.inspect_image(ref)
        except docker.errors.ImageNotFound:
            return None
        except docker.errors.APIError as exc:
            if exc.status_code == 404:
                return None
            raise self._failure("inspect", exc) from None

    def tag(self, image_id: str, ref: str) -> None:
        repo, _, tag = ref.rpartition(":")
        self._call("tag", lambda: self.client.api.tag(image_id, repo, tag, force=True))

    def remove(self, ref: str) -> None:
        try:
            self.client.api.remove_image(ref, force=True)
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.APIError as exc:
            raise self._failure("remove", exc) from None

    def import_rootfs(self, tarball: Path, ref: str, changes: list[str]) -> str:
        repo, _, tag = ref.rpartition(":")
        result = self._call("import", lambda: self.client.api.import_image(
            src=str(tarball), repository=repo, tag=tag, changes=changes))
        image = self.image(ref)
        if image is None:
            raise BuildFailure(f"docker import reported {result!r} but {ref} is missing", "check the dockerd log")
        return image["Id"]

    def history(self, ref: str) -> list[dict[str, Any]]:
        return self._call("history", lambda: self.client.api.history(ref))

    # -- build ----------------------------------------------------------------------

    def build(self, context: Path, tag: str, labels: dict[str, str], log: EventLog,
              on_step: Callable[[int, int, str], None] | None = None) -> BuiltImage:
        """Build with live progress: step N/M, the instruction, and seconds per step."""
        steps: list[tuple[str, float]] = []
        current, started = None, time.monotonic()
        image_id, error, tail = None, None, []
        try:
            stream = self.client.api.build(path=str(context), tag=tag, labels=labels, rm=True, forcerm=True,
                                           pull=False, network_mode="none", decode=True)
            for chunk in stream:
                if "stream" in chunk:
                    for line in chunk["stream"].splitlines():
                        match = _STEP_RE.match(line.strip())
                        if match:
                            now = time.monotonic()
                            if current is not None:
                                steps.append((current, now - started))
                                log.emit("engine", f"step done in {now - started:.1f}s")
                            current, started = match.group(3), now
                            log.emit("engine", f"step {match.group(1)}/{match.group(2)}: {match.group(3)[:110]}",
                                     step=int(match.group(1)), steps=int(match.group(2)))
                            if on_step:
                                on_step(int(match.group(1)), int(match.group(2)), match.group(3))
                        elif line.strip():
                            tail = (tail + [line.rstrip()])[-40:]
                if "aux" in chunk and "ID" in chunk["aux"]:
                    image_id = chunk["aux"]["ID"]
                if "error" in chunk:
                    error = chunk["error"].strip()
        except (docker.errors.APIError, docker.errors.BuildError, requests.exceptions.RequestException) as exc:
            raise self._failure("build", exc) from None
        if current is not None:
            steps.append((current, time.monotonic() - started))
        if error or image_id is None:
            detail = "\n".join(tail[-25:])
            raise BuildFailure(f"image build failed at `{(current or '?')[:120]}`: {error or 'no image produced'}"
                               + (f"\n--- last build output ---\n{detail}" if detail else ""),
                               "read the step output above; the failing input is named there")
        info = self.image(image_id) or {}
        return BuiltImage(id=image_id, tag=tag, size_bytes=int(info.get("Size", 0)), step_seconds=tuple(steps))

    # -- containers -----------------------------------------------------------------

    def run(self, image: str, command: list[str] | None = None, *, network: str = "none",
            volumes: dict[str, dict[str, str]] | None = None, environment: dict[str, str] | None = None,
            user: str | None = None, entrypoint: list[str] | None = None, timeout: float = 3600,
            mem_limit: str | None = None, labels: dict[str, str] | None = None) -> RunResult:
        """Run to completion and return exit code and combined output; the container is removed."""
        try:
            container = self.client.containers.create(
                image, command, network_mode=network, volumes=volumes or {}, environment=environment or {},
                user=user, entrypoint=entrypoint, detach=True, mem_limit=mem_limit, labels=labels or {})
        except docker.errors.ImageNotFound:
            raise BuildFailure(f"image {image} not found", "build it first with `python -m build images/<name>`") \
                from None
        except docker.errors.APIError as exc:
            raise self._failure("run", exc) from None
        try:
            container.start()
            status = container.wait(timeout=timeout)
            output = container.logs(stdout=True, stderr=True).decode(errors="replace")
            return RunResult(exit_code=int(status.get("StatusCode", -1)), output=output)
        except requests.exceptions.ReadTimeout:
            container.kill()
            raise BuildFailure(f"container from {image} ran past {timeout}s", "look for a hang in its output")
        finally:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass

    # -- helpers --------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            raise self._failure(what, exc) from None

    @staticmethod
    def _failure(what: str, exc: Exception) -> BuildFailure:
        if isinstance(exc, requests.exceptions.ConnectionError):
            return BuildFailure(f"lost the Docker engine during {what}: {str(exc).split('(Caused by')[0]}",
                                ENGINE_FIX)
        explanation = getattr(exc, "explanation", None) or str(exc)
        return BuildFailure(f"docker {what} failed: {explanation}", "check the message above and the dockerd log")
