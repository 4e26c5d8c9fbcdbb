"""Session-wide fixtures shared by every tier: the engine, and the smoke image built once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def docker_engine_available() -> bool:
    try:
        import docker
        docker.from_env(timeout=10).ping()
        return True
    except Exception:  # noqa: BLE001 - any failure means "no engine"
        return False


@pytest.fixture(scope="session")
def engine():
    """The real Docker engine. Engine-tier tests FAIL (not skip) without one: CI starts dockerd."""
    from build.engine import connect
    return connect()


def run_build_cli(*args: str, env: dict[str, str] | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "build", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def smoke_build(engine, tmp_path_factory):
    """`python -m build images/smoke --json`, exactly as a user runs it; built once per session."""
    out = tmp_path_factory.mktemp("smoke-out")
    proc = run_build_cli("images/smoke", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    return {"report": report, "tag": report["tag"], "out": out, "stderr": proc.stderr}


@pytest.fixture(scope="session")
def smoke_image(smoke_build) -> str:
    """Tag of the built smoke image (e.g. for `docker run <tag> finetune ...`)."""
    return smoke_build["tag"]
