"""Engine tier: the assembled image is reproducible, as a user checks it.

`python -m build verify-reproducible images/smoke` builds from two fresh clones with fresh
caches, the second under umask 077, another time zone and another host name, and pushes both
to a real registry: image ID, diffIDs, manifest digest, lock and pushed digest must agree. A
new commit must rebuild only the app layer, and the classic builder stays a working fallback."""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.conftest import run_build_cli

pytestmark = pytest.mark.engine


def test_two_fresh_clones_under_other_conditions_build_and_push_one_image(engine, registry, smoke_build, tmp_path):
    from build.cache import default_cache_root

    work = tmp_path / "work"
    # this test run's smoke build has downloaded the pinned wheels and .debs once; both builds share
    # those bytes and make everything else (resolution, base, layers, image) from scratch
    proc = run_build_cli("verify-reproducible", "images/smoke", "--work", str(work), "--json",
                         "--inputs-from", str(default_cache_root()),
                         "--push-to", f"{registry.address}/ftimage/repro", timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    a, b = result["builds"]
    assert result["reproducible"] is True and all(row["same"] for row in result["rows"])
    assert "umask 022" in a["conditions"] and "umask 077" in b["conditions"] and "Kiritimati" in b["conditions"]
    if os.geteuid() == 0:
        assert "host name reproducibility-check" in b["conditions"]
    assert a["image_id"] == b["image_id"] and a["manifest_digest"] == b["manifest_digest"]
    assert a["diff_ids"] == b["diff_ids"] and len(a["diff_ids"]) == 4
    assert a["lock_sha256"] == b["lock_sha256"]
    assert a["pushed_digest"] == b["pushed_digest"] == a["manifest_digest"]
    for label in "AB":   # two caches, each with its own resolution, base and layers made from scratch
        assert (work / f"cache-{label}" / "resolutions").is_dir() and (work / f"cache-{label}" / "layers").is_dir()
    assert (work / "clone-A" / ".git").is_dir() and (work / "clone-B" / ".git").is_dir()
    inspected = engine.image(a["image_id"])
    assert inspected is not None and inspected["Id"] == a["image_id"]
    assert inspected["RootFS"]["Layers"] == a["diff_ids"]


@pytest.fixture
def restore_smoke(engine, smoke_build, tmp_path):
    """These tests retag (and prune) the smoke image; afterwards the tag is this test run's
    assembled image again, for the other engine tests. A second tag keeps the assembled image in
    the engine meanwhile (a build prunes only its own name's tags), so the restoring build finds
    it by ID and loads nothing."""
    image_id = smoke_build["report"]["image_id"]
    keep = f"ftimage-test/smoke-kept:{image_id[7:19]}"
    engine.tag(image_id, keep)
    try:
        yield
        restored = run_build_cli("images/smoke", "--json", "--out", str(tmp_path / "restored"))
        assert restored.returncode == 0, restored.stderr[-4000:]
        assert json.loads(restored.stdout)["image_id"] == image_id
    finally:
        engine.remove(keep)


def test_a_new_commit_rebuilds_and_sends_only_the_app_layer(smoke_build, restore_smoke, tmp_path):
    later = int(time.time()) + 86400        # after every wheel and base time, so no cap moves them
    reports = []
    for epoch in (later, later + 3600):
        out = tmp_path / f"out-{epoch}"
        proc = run_build_cli("images/smoke", "--json", "--out", str(out), env={"SOURCE_DATE_EPOCH": str(epoch)})
        assert proc.returncode == 0, proc.stderr[-4000:]
        reports.append(json.loads(proc.stdout))
    first, second = reports
    states = {name.split()[1].split(":")[0]: state for name, state in second["cache"].items()
              if name.startswith("layer ")}
    assert states == {"base": "hit local", "venv": "hit local", "lock": "hit local", "app": "miss"}
    assert second["layers_sent"] == 1 and second["image_id"] != first["image_id"]
    assert second["diff_ids"][:3] == first["diff_ids"][:3] and second["diff_ids"][3] != first["diff_ids"][3]


def test_the_classic_builder_remains_a_working_fallback(engine, restore_smoke, tmp_path):
    proc = run_build_cli("images/smoke", "--json", "--builder", "dockerfile", "--out", str(tmp_path / "classic"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["builder"] == "dockerfile" and not report["manifest_digest"]
    assert report["steps"] and "COPY --from=builder" in proc.stderr   # the engine ran the rendered Dockerfile
    info = engine.run(report["tag"], ["info"])
    assert info.exit_code == 0 and "plan key" in info.output
