"""How the Docker engine wrapper reports a full disk, against a stub SDK client (no dockerd)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from build.engine.docker_engine import DockerEngine
from build.errors import BuildFailure
from contracts.events import EventLog

pytestmark = pytest.mark.unit


class StubAPI:
    def __init__(self, base_url: str, chunks: list[dict]):
        self.base_url, self.chunks = base_url, chunks

    def build(self, **_kwargs):
        return iter(self.chunks)


def engine_with(tmp_path, chunks, base_url="http+docker://localhost") -> DockerEngine:
    client = SimpleNamespace(api=StubAPI(base_url, chunks), info=lambda: {"DockerRootDir": str(tmp_path)})
    return DockerEngine(client)


def test_a_build_that_fills_the_disk_names_the_disk_and_the_fix(tmp_path):
    engine = engine_with(tmp_path, [
        {"stream": "Step 4/9 : RUN python3 -m venv /opt/ftimage/venv && pip install -r lock.txt\n"},
        {"stream": "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"},
        {"error": "The command '/bin/sh -c python3 -m venv' returned a non-zero code: 1"}])
    with pytest.raises(BuildFailure) as failure:
        engine.build(tmp_path, "img:1", labels={}, log=EventLog(quiet=True))
    message = failure.value.render()
    assert "disk filled up while building img:1" in message and "RUN python3 -m venv" in message
    assert str(tmp_path) in message and "GiB free now" in message
    assert "docker image prune" in message and "finished steps are reused" in message


def test_other_build_failures_keep_their_own_output(tmp_path):
    engine = engine_with(tmp_path, [{"stream": "Step 1/2 : RUN false\n"}, {"stream": "boom\n"},
                                    {"error": "returned a non-zero code: 1"}])
    with pytest.raises(BuildFailure) as failure:
        engine.build(tmp_path, "img:1", labels={}, log=EventLog(quiet=True))
    assert "boom" in str(failure.value) and "disk" not in str(failure.value)


def test_disk_space_is_read_only_for_an_engine_on_this_host(tmp_path):
    root, free = engine_with(tmp_path, []).disk_space()
    assert root == str(tmp_path) and free > 0
    assert engine_with(tmp_path, [], base_url="https://build-host:2376").disk_space() is None
