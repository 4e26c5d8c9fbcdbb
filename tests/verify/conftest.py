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


def _run_verify(*args: str, extra_pythonpath: Path | None = None, env: dict | None = None, timeout: int = 180,
                python: Path | None = None):
    """Run `python -m verify ARGS` (python: another interpreter, e.g. a venv's); returns (returncode,
    stdout, stderr). No lock unless --lock is given."""
    paths = [str(extra_pythonpath)] if extra_pythonpath else []
    paths.append(str(REPO))
    # COLUMNS fixed: the table wraps to the terminal, and a width some library set in this worker
    # would split the words the tests look for
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "FTIMAGE_LOCK": "/nonexistent/lock.json",
                "COLUMNS": "200", **(env or {})}
    proc = subprocess.run([str(python or sys.executable), "-m", "verify", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="session")
def run_verify():
    return _run_verify


def table_contradictions(rows: dict[str, dict]) -> list[str]:
    """Rows of one table that contradict each other: a kernel that PASSes in extensions.* or
    dispatch.* must appear in the environment rows (where the table has them), and
    environment.triton_runtime must not call a Triton kernel missing that another row passes."""
    from verify.provenance import MANIFEST_KINDS

    env = {name: row for name, row in rows.items() if name.startswith("environment.")}
    if not env:
        return []
    said = " ".join(f"{name} {row.get('detail') or ''}" for name, row in env.items())
    triton = (env.get("environment.triton_runtime") or {}).get("detail") or ""
    problems = []
    for name, row in rows.items():
        if row["status"] != "PASS" or not name.startswith(("extensions.", "dispatch.")):
            continue
        data = row.get("data") or {}
        origin = data.get("provenance") or {}
        package = origin.get("package") or (name.split(".")[1] if name.count(".") == 1 and name.startswith(
            "extensions.") else data.get("package") or (data.get("implementation") or "").split(".")[0])
        if not package or name == "dispatch.kernel_hub":
            continue
        distribution = (origin.get("distribution") or "").split(" ")[0]
        if f"`{package}`" not in said and not (distribution and distribution in said):
            problems.append(f"{name} PASSes for `{package}`, which no environment row names")
        kind = origin.get("kind") or MANIFEST_KINDS.get(package, ("", ""))[0]
        if kind == "triton" and ("no Triton kernel package" in triton or "no triton-kind kernel" in triton):
            problems.append(f"{name} PASSes for `{package}`, but environment.triton_runtime says: {triton}")
    return problems


@pytest.fixture(scope="session")
def contradictions():
    return table_contradictions


@pytest.fixture(scope="session")
def rows_by_check():
    """The rows of a JSON table by check; every table read this way must not contradict itself."""
    def rows(report_json: str) -> dict[str, dict]:
        found = {r["check"]: r for r in json.loads(report_json)["results"]}
        assert not table_contradictions(found), table_contradictions(found)
        return found
    return rows
