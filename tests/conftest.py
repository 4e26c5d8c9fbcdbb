"""Session-wide fixtures shared by every tier: the engine, and the smoke image built once.

The suite runs on several pytest-xdist workers (`-n` in pyproject.toml). Tests that share one
engine-wide thing run on one worker, in order: the smoke image (built once, retagged and
pruned by some tests) and everything in the engine tier form the group "engine"; the kernel
tier (its builder image and its one long compile) forms the group "kernel". Every other test
goes to whichever worker is free. The two groups are queued first, so the longest chains start
at once instead of after the quick tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Several workers share a few cores, and each one's in-process tensors and verify runs would
# otherwise start an OpenMP thread per core (training ranks get a share from the launcher):
# threads that spin on a core while they wait for one. Beside a busy build on 2 cores, `python -m verify` took 15-25
# CPU seconds with the default threads and 9-10 with one. Set before anything imports torch;
# subprocesses inherit it, and a test that needs another count sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The session fixtures whose state is engine-wide: a test that uses one runs in the engine group.
ENGINE_WIDE_FIXTURES = frozenset({"engine", "smoke_build", "smoke_image"})


def xdist_group_of(item: pytest.Item) -> str | None:
    """The worker group a test must share, or None when any worker may run it."""
    if item.get_closest_marker("kernel") and not {"smoke_build", "smoke_image"} & set(item.fixturenames):
        return "kernel"
    if item.get_closest_marker("engine") or ENGINE_WIDE_FIXTURES & set(item.fixturenames):
        return "engine"
    return None


# Seconds a test of these tiers may take, setup included, before it fails with its stack: many
# times the slowest one on a loaded 2-core machine, so only a hang reaches it. The engine and
# kernel tiers bound each build and container themselves.
TIMEOUTS = {"unit": 600, "training": 1200}


def timeout_of(item: pytest.Item) -> int | None:
    if item.get_closest_marker("engine") or item.get_closest_marker("kernel"):
        return None
    limits = [seconds for marker, seconds in TIMEOUTS.items() if item.get_closest_marker(marker)]
    return max(limits) if limits else None


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads the groups into node IDs
def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        groups[item.nodeid] = group = xdist_group_of(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        seconds = timeout_of(item)
        if seconds and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(seconds))
    # the long, ordered chains first (the kernel compile is the longest), then the rest as collected
    first = {"kernel": 0, "engine": 1}
    items.sort(key=lambda item: first.get(groups[item.nodeid], 2))


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
    from tests.fixtures.containers import with_test_env

    engine = connect()
    run = engine.run

    def run_with_test_env(image, command=None, *, environment=None, **options):
        return run(image, command, environment=with_test_env(environment), **options)

    engine.run = run_with_test_env     # every container a test starts through the engine
    return engine


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


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Debian's docker-registry on a free 127.0.0.1 port, for one test module."""
    from tests.fixtures.registry import Registry

    running = Registry(tmp_path_factory.mktemp("registry"))
    yield running
    running.stop()
