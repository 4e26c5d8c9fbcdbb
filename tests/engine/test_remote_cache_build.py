"""Engine tier: `images/smoke` built with `--cache-registry` into a real registry (Debian's
docker-registry on a free 127.0.0.1 port), then built again with a fresh, empty layer and
kernel cache and `--cache-registry --cache-key`: every layer comes from the registry (`hit
registry`), re-hashed, and the image ID is the same. images/smoke compiles no kernels, so
kernel hits are proven by the unit tests (tests/build/test_remote_cache.py) against the same
registry.

Runner A is a runner that built this commit before: it uses the usual cache, which the shared
smoke_build fixture filled, and pushes every layer it found there (a build pushes what it made or
found locally). Runner B's cache is seeded with the downloads only (wheels, sources, debs,
hard-linked from the usual cache, as verify-reproducible's --inputs-from does): what is under
test is what a build makes, not what it downloads."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from build.cache import default_cache_root
from contracts import folder_guard
from tests.conftest import run_build_cli
from tests.fixtures.keys import write_p256_pair
from tests.fixtures.registry import Registry

pytestmark = pytest.mark.engine


def fresh_cache(root: Path) -> Path:
    inputs = default_cache_root()
    folder_guard.claim(root, folder_guard.CACHE_MARKER, what="cache folder", option="--cache")
    for name in ("wheels", "sources", "debs"):
        if (inputs / name).is_dir() and root != inputs:
            linked = subprocess.run(["cp", "-al", str(inputs / name), str(root / name)], capture_output=True)
            if linked.returncode != 0:
                shutil.rmtree(root / name, ignore_errors=True)
    return root


def test_a_second_runner_with_an_empty_cache_takes_every_layer_from_the_registry(engine, smoke_build, tmp_path):
    registry = Registry(tmp_path / "registry")
    try:
        private, public = write_p256_pair(tmp_path)
        repository = f"{registry.address}/team/ftimage-cache"
        # one SOURCE_DATE_EPOCH for both runners, as two CI runners at one commit have
        epoch = {"SOURCE_DATE_EPOCH": subprocess.run(["git", "log", "-1", "--format=%ct"], capture_output=True,
                                                     text=True, check=True).stdout.strip()}
        first = run_build_cli("images/smoke", "--json", "--out", str(tmp_path / "out-a"),
                              "--cache-registry", repository, "--sign", str(private), env=epoch)
        assert first.returncode == 0, first.stderr[-4000:]
        a = json.loads(first.stdout)
        layers = [name for name in a["cache"] if name.startswith("layer ")]
        # every layer, and the bases and resolution a fresh runner reads instead of bootstrapping and resolving
        assert layers and a["remote_cache"]["pushed"] >= len(layers) and not a["remote_cache"]["refused"]

        second = run_build_cli("images/smoke", "--json", "--out", str(tmp_path / "out-b"),
                               "--cache", str(fresh_cache(tmp_path / "cache-b")),
                               "--cache-registry", repository, "--cache-key", str(public), env=epoch)
        assert second.returncode == 0, second.stderr[-4000:]
        b = json.loads(second.stdout)
        assert {name: b["cache"][name] for name in layers} == {name: "hit registry" for name in layers}
        assert b["image_id"] == a["image_id"] and b["diff_ids"] == a["diff_ids"]
        assert b["manifest_digest"] == a["manifest_digest"]
        record = b["remote_cache"]
        assert record["hits"] >= len(layers) and record["trust"].startswith("signed by sha256:")
        assert record["bytes_pulled"] > 0 and not record["refused"] and not record["unavailable"]
        assert "WARN" not in second.stderr
    finally:
        registry.stop()
