"""Images more than one engine-tier module runs, built once per session."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_build_cli


@pytest.fixture(scope="session")
def trl_image(engine, smoke_build, tmp_path_factory):
    """`python -m build images/smoke-trl`: the smoke image's base and kernels, plus TRL
    (test_trl_image.py, and test_any_uid.py under dockerd and podman)."""
    out = tmp_path_factory.mktemp("smoke-trl-out")
    proc = run_build_cli("images/smoke-trl", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    tag = json.loads(proc.stdout)["tag"]
    yield tag
    engine.client.images.remove(tag, force=True)
