"""The container engine behind a small interface. Docker (through the docker SDK) is the one
real implementation (docker_engine.py); tests drive the pipeline with a fake
(tests/fakes/engine.py), so the cache-hit and rebuild logic is covered without dockerd.
"""
from __future__ import annotations

from build.engine.interface import BuiltImage, ContainerStartFailed, Engine, RunResult

__all__ = ["BuiltImage", "ContainerStartFailed", "Engine", "RunResult", "connect"]


def connect() -> Engine:
    # the docker SDK loads only when an engine is asked for: --plan and --render run without it
    from build.engine.docker_engine import DockerEngine

    return DockerEngine.connect()
