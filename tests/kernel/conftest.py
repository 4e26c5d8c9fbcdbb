"""The kernel tier's session build, shared by its modules."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_build_cli


@pytest.fixture(scope="session")
def kernel_smoke(engine, tmp_path_factory):
    """`python -m build images/kernel-smoke --json`, twice: the second run must compile nothing."""
    out = tmp_path_factory.mktemp("kernel-smoke")
    first = run_build_cli("images/kernel-smoke", "--json", "--out", str(out), timeout=5400)
    assert first.returncode == 0, first.stderr[-5000:]
    second = run_build_cli("images/kernel-smoke", "--json", "--out", str(out), timeout=1800)
    assert second.returncode == 0, second.stderr[-5000:]
    return {"first": json.loads(first.stdout), "second": json.loads(second.stdout), "out": out,
            "log": first.stderr}
