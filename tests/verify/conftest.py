"""Fixtures for verify/ tests: truthful locks for this machine, and `python -m verify` in a fresh
interpreter (pytest runs with --import-mode=importlib, so helpers are fixtures, not imports)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def env_lock():
    from tests.fixtures.locks import environment_lock

    return environment_lock()


@pytest.fixture
def cpu_lock_path(tmp_path, env_lock) -> Path:
    path = tmp_path / "build.lock.json"
    path.write_text(env_lock.to_json())
    return path


def _run_verify(*args: str, extra_pythonpath: Path | None = None, env: dict | None = None, timeout: int = 180):
    """Run `python -m verify ARGS`; returns (returncode, stdout, stderr). No lock unless --lock is given."""
    paths = [str(extra_pythonpath)] if extra_pythonpath else []
    paths.append(str(REPO))
    # COLUMNS fixed: the table wraps to the terminal, and a width some library set in this worker
    # would split the words the tests look for
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "FTIMAGE_LOCK": "/nonexistent/lock.json",
                "COLUMNS": "200", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "verify", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="session")
def run_verify():
    return _run_verify


@pytest.fixture(scope="session")
def rows_by_check():
    def rows(report_json: str) -> dict[str, dict]:
        return {r["check"]: r for r in json.loads(report_json)["results"]}
    return rows
