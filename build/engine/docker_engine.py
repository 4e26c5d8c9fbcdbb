"""The Docker engine, through the docker SDK: build (the classic builder), run, inspect, load, save, tag
and remove.

The SDK speaks only the classic builder (no BuildKit: docker/docker-py #2230), so our
Dockerfiles use no `RUN --mount` and every RUN step runs with networking disabled.
"""
from __future__ import annotations

import io
import re
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import requests.exceptions

from build.engine.diskspace import DISK_FIX
from build.engine.interface import BuiltImage, ContainerStartFailed, RunResult
from build.errors import BuildFailure
from contracts.events import EventLog, Progress

_STEP_RE = re.compile(r"^Step (\d+)/(\d+) : (.*)$")

ENGINE_FIX = ("start a Docker engine: `apt-get install -y docker.io` then `dockerd &` "
              "(or `systemctl start docker`); set DOCKER_HOST if it listens elsewhere")


class DockerEngine:
    def __init__(self, client: docker.DockerClient):
        self.client = client

    @classmethod
    def connect(cls, timeout: int = 600) -> DockerEngine:
        try:
            client = docker.from_env(timeout=timeout)
            client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            reason = str(exc).split("(Caused by")[0].strip()
            raise BuildFailure(f"cannot reach the Docker engine: {reason}", ENGINE_FIX) from None
        return cls(client)

    # -- images ---------------------------------------------------------------------

    def image(self, ref: str) -> dict[str, Any] | None:
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

    def remove(self, ref: str) -> bool:
        try:
            self.client.api.remove_image(ref, force=True)
        except docker.errors.ImageNotFound:
            return False
        except docker.errors.APIError as exc:
            if exc.status_code == 409:  # still used by a container or child image: keep it
                return False
            raise self._failure("remove", exc) from None
        return True

    def load_archive(self, archive: Path, ref: str) -> str:
        def chunks():
            with archive.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    yield chunk

        return self.load_stream(chunks(), ref)

    def load_stream(self, chunks, ref: str) -> str:
        """`docker load` an archive given as an iterable of byte chunks (sent chunked, never
        written to disk here); returns the image ID of `ref`."""
        def load():
            for item in self.client.api.load_image(chunks):
                if isinstance(item, dict) and item.get("error"):
                    raise BuildFailure(f"docker load of {ref} failed: {item['error']}", "check the dockerd log")

        self._call("load", load)
        image = self.image(ref)
        if image is None:
            raise BuildFailure(f"docker load finished but {ref} is missing", "check the dockerd log")
        return image["Id"]

    def save(self, ref: str, dest: Path) -> None:
        """`docker save` one image into the file `dest` (a docker-archive), streamed."""
        def save():
            with dest.open("wb") as fh:
                for chunk in self.client.api.get_image(ref, chunk_size=1 << 20):
                    fh.write(chunk)

        self._call("save", save)

    def history(self, ref: str) -> list[dict[str, Any]]:
        return self._call("history", lambda: self.client.api.history(ref))

    def images_with_label(self, label: str) -> list[dict[str, Any]]:
        images = self._call("list", lambda: self.client.api.images(filters={"label": label}))
        return sorted(images, key=lambda i: i.get("Created", 0), reverse=True)

    def disk_space(self) -> tuple[str, int] | None:
        # only a local engine (the SDK's unix-socket URL) keeps its data-root on this host
        if not self.client.api.base_url.startswith("http+docker://"):
            return None
        root = self._call("info", self.client.info).get("DockerRootDir")
        try:
            return (root, shutil.disk_usage(root).free) if root else None
        except OSError:
            return None

    # -- build ----------------------------------------------------------------------

    def build(self, context: Path, tag: str, labels: dict[str, str], log: EventLog, *,
              expected_steps_seconds: float | None = None) -> BuiltImage:
        """Build with live progress: step N/M, the instruction, elapsed time and an ETA."""
        steps: list[tuple[str, float]] = []
        progress = Progress(log, "image", tag, expected_seconds=expected_steps_seconds)
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
                            current, started = match.group(3), now
                            progress.update(int(match.group(1)) - 1, match.group(3)[:110],
                                            total=int(match.group(2)), force=True)
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
        if error and "no space left on device" in (error + "\n".join(tail)).lower():
            root, free = self.disk_space() or ("Docker's data-root", 0)
            raise BuildFailure(f"the Docker engine's disk filled up while building {tag} at "
                               f"`{(current or '?')[:120]}`: {free / 2 ** 30:.1f} GiB free now at {root}",
                               DISK_FIX.format(root=root) + "; then rerun: finished steps are reused")
        if error or image_id is None:
            detail = "\n".join(tail[-25:])
            raise BuildFailure(f"image build failed at `{(current or '?')[:120]}`: {error or 'no image produced'}"
                               + (f"\n--- last build output ---\n{detail}" if detail else ""),
                               "read the step output above; the failing input is named there")
        progress.finish(f"built {image_id[:19]}")
        info = self.image(image_id) or {}
        return BuiltImage(id=image_id, tag=tag, size_bytes=int(info.get("Size", 0)), step_seconds=tuple(steps))

    # -- containers -----------------------------------------------------------------

    def run(self, image: str, command: list[str] | None = None, *, network: str = "none",
            volumes: dict[str, dict[str, str]] | None = None, environment: dict[str, str] | None = None,
            user: str | None = None, entrypoint: list[str] | None = None, timeout: float = 3600,
            mem_limit: str | None = None, labels: dict[str, str] | None = None,
            on_output: Callable[[str], None] | None = None, gpus: int | None = None) -> RunResult:
        devices = [docker.types.DeviceRequest(count=gpus, capabilities=[["gpu"]])] if gpus else None
        try:
            container = self.client.containers.create(
                image, command, network_mode=network, volumes=volumes or {}, environment=environment or {},
                user=user, entrypoint=entrypoint, detach=True, mem_limit=mem_limit, labels=labels or {},
                device_requests=devices)
        except docker.errors.ImageNotFound:
            raise BuildFailure(f"image {image} not found", "build it first with `python -m build images/<name>`") \
                from None
        except docker.errors.APIError as exc:
            raise self._failure("run", exc) from None
        try:
            try:
                container.start()
            except docker.errors.APIError as exc:
                explanation = str(getattr(exc, "explanation", None) or exc)
                raise ContainerStartFailed(f"a container from {image} could not start: {explanation}",
                                           "check the command and the image's PATH", explanation) from None
            if on_output is not None:
                self._stream(container, on_output, timeout)
            status = container.wait(timeout=timeout)
            output = container.logs(stdout=True, stderr=True).decode(errors="replace")
            stdout = container.logs(stdout=True, stderr=False).decode(errors="replace")
            return RunResult(exit_code=int(status.get("StatusCode", -1)), output=output, stdout=stdout)
        except requests.exceptions.ReadTimeout:
            container.kill()
            raise BuildFailure(f"container from {image} ran past {timeout}s", "look for a hang in its output") \
                from None
        finally:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass

    @staticmethod
    def _stream(container, on_output: Callable[[str], None], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = ""
        for chunk in container.logs(stdout=True, stderr=True, stream=True, follow=True):
            pending += chunk.decode(errors="replace")
            *lines, pending = pending.split("\n")
            for line in lines:
                on_output(line)
            if time.monotonic() > deadline:
                raise requests.exceptions.ReadTimeout()
        if pending:
            on_output(pending)

    def remove_containers(self, label: str) -> int:
        removed = 0
        try:
            for container in self.client.containers.list(all=True, filters={"label": label}):
                container.remove(force=True)
                removed += 1
        except docker.errors.APIError:
            pass
        return removed

    def read_file(self, image: str, path: str, *, limit: int) -> bytes | None:
        # a created container is never started: nothing in the image runs
        container = self._call("create", lambda: self.client.containers.create(image, ["/nonexistent"],
                                                                               network_mode="none"))
        try:
            try:
                stream, stat = container.get_archive(path)
            except docker.errors.NotFound:
                return None
            if not stat or int(stat.get("size", 0)) > limit:
                return None
            data = b""
            for chunk in stream:
                data += chunk
                if len(data) > limit + (1 << 20):   # the tar framing adds headers, never megabytes
                    return None
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                member = next((m for m in tar.getmembers() if m.isfile()), None)
                handle = tar.extractfile(member) if member is not None else None
                return handle.read() if handle is not None else None
        except (docker.errors.APIError, tarfile.TarError) as exc:
            raise self._failure("read", exc) from None
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
