"""Kernel tier: a fresh runner builds images/kernel-smoke from a warm registry while it can
reach nothing else: no package index, no Debian mirror, no engine that holds anything.

Runner A is the kernel tier's session build (`kernel_smoke`), run once more with
`--cache-registry R --sign KEY`: everything it holds locally (kernels, layers, both bases, the
pip resolution) is pushed to a registry this test starts. Runner B has an empty `--cache` and a
second dockerd with its own data-root, exec-root and socket. B, that dockerd and a registry
serving A's storage run in one network namespace (`unshare -n`) whose only interface is its
own loopback; B reaches the engine over its unix socket. pip is pointed at nothing (no index,
no find-links, no config), so any download B tried would fail the build. B must succeed with:
no compile, no debootstrap, no wheel or source or deb in its cache, and A's lock and image ID.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from build.spec import REPO_ROOT
from tests.conftest import run_build_cli
from tests.fixtures.keys import write_p256_pair
from tests.fixtures.registry import REGISTRY_BIN, Registry

pytestmark = pytest.mark.kernel

ISOLATED = """\
set -u
ip link set lo up
{registry} serve {registry_config} > {work}/registry-b.log 2>&1 &
registry=$!
dockerd --data-root {work}/docker-data --exec-root {work}/docker-exec --pidfile {work}/docker.pid \\
    -H unix://{work}/docker.sock --bridge=none --iptables=false --ip-masq=false > {work}/dockerd-b.log 2>&1 &
dockerd=$!
for _ in $(seq 120); do
    [ -S {work}/docker.sock ] && curl -fsS --unix-socket {work}/docker.sock http://d/_ping >/dev/null 2>&1 \\
        && curl -fsS http://{address}/v2/ >/dev/null 2>&1 && break
    sleep 0.5
done
cd {repo}
export DOCKER_HOST=unix://{work}/docker.sock PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS=
{python} -m build images/kernel-smoke --plan --cache {work}/cache-b \\
    --cache-registry {address}/team/ftimage-cache --cache-key {public} > {work}/plan.txt 2> {work}/plan.log
{python} -m build images/kernel-smoke --json --cache {work}/cache-b --out {work}/out-b \\
    --cache-registry {address}/team/ftimage-cache --cache-key {public} > {work}/b.json 2> {work}/b.log
status=$?
kill $dockerd; wait $dockerd
kill $registry; wait $registry
exit $status
"""


def isolated_runner_b(work: Path, storage: Path, public: Path, address: str) -> subprocess.CompletedProcess:
    """`address`: A's registry's; B's serves A's storage at the same address on the namespace's own
    loopback (the entries' signatures name the repository by it)."""
    config = work / "registry-b.yml"
    config.write_text(yaml.safe_dump({"version": 0.1, "log": {"level": "warn"},
                                      "storage": {"filesystem": {"rootdirectory": str(storage)}},
                                      "http": {"addr": address}}))
    script = work / "runner-b.sh"
    script.write_text(ISOLATED.format(registry=REGISTRY_BIN, registry_config=config, work=work, address=address,
                                      repo=REPO_ROOT, python=sys.executable, public=public))
    return subprocess.run(["unshare", "-n", "bash", str(script)], capture_output=True, text=True, timeout=1200,
                          env={k: v for k, v in os.environ.items() if k != "DOCKER_HOST"})


def downloaded(cache: Path) -> dict[str, int]:
    """Files in each download folder of a cache: what a build fetched from outside the registry."""
    return {name: sum(1 for p in (cache / name).rglob("*") if p.is_file()) if (cache / name).is_dir() else 0
            for name in ("wheels", "sources", "debs")}


@pytest.fixture(scope="module")
def warm_registry(kernel_smoke, tmp_path_factory):
    """A registry holding everything runner A (the session build, once more) pushed, signed."""
    root = tmp_path_factory.mktemp("fresh-runner")
    registry = Registry(root / "registry")
    private, public = write_p256_pair(root)
    epoch = {"SOURCE_DATE_EPOCH": subprocess.run(["git", "log", "-1", "--format=%ct"], capture_output=True,
                                                 text=True, check=True, cwd=REPO_ROOT).stdout.strip()}
    pushed = run_build_cli("images/kernel-smoke", "--json", "--out", str(root / "out-a"),
                           "--cache-registry", f"{registry.address}/team/ftimage-cache", "--sign", str(private),
                           env=epoch)
    try:
        assert pushed.returncode == 0, pushed.stderr[-4000:]
        a = json.loads(pushed.stdout)
        assert not a["remote_cache"]["refused"] and a["remote_cache"]["pushed"] > 0, a["remote_cache"]
        yield {"registry": registry, "public": public, "a": a, "storage": root / "registry" / "storage"}
    finally:
        registry.stop()


@pytest.fixture(scope="module")
def runner_b(warm_registry, tmp_path_factory):
    """Runner B in its namespace: its `--plan`, then its build (the work folder holds both)."""
    work = tmp_path_factory.mktemp("runner-b")
    done = isolated_runner_b(work, warm_registry["storage"], warm_registry["public"],
                             warm_registry["registry"].address)
    try:
        yield {"done": done, "work": work}
    finally:
        shutil.rmtree(work / "docker-data", ignore_errors=True)
        shutil.rmtree(work / "docker-exec", ignore_errors=True)


def test_the_plan_of_a_fresh_runner_says_per_stage_what_comes_from_the_registry(runner_b):
    """B's `--plan`, run first, on its empty cache and empty engine: every stage from the registry."""
    text = (runner_b["work"] / "plan.txt").read_text()
    assert "where each stage's inputs come from on this runner" in text, \
        (text, (runner_b["work"] / "plan.log").read_text()[-3000:])
    rows = {line.split("  ")[0].strip(): line for line in text.splitlines()
            if line.startswith(("base ", "wheelhouse", "kernel ", "layer "))}
    for stage in ("base builder", "base runtime", "wheelhouse", "kernel causal-conv1d", "kernel flash-attn",
                  "layer base 1/1", "layer app"):
        assert stage in rows and " registry " in rows[stage] and "MiB" in rows[stage], (stage, text)
    assert "0 stage(s) fetch from outside the registry" in text, text


def test_a_fresh_runner_in_a_namespace_that_reaches_only_the_registry_builds_the_same_image(warm_registry,
                                                                                            runner_b):
    work, done, a = runner_b["work"], runner_b["done"], warm_registry["a"]
    b_log = (work / "b.log").read_text() if (work / "b.log").exists() else ""
    assert done.returncode == 0, (done.stderr[-2000:], b_log[-6000:], (work / "dockerd-b.log").read_text()[-2000:])
    b = json.loads((work / "b.json").read_text())
    assert b["image_id"] == a["image_id"] and b["lock_sha256"] == a["lock_sha256"]
    assert b["manifest_digest"] == a["manifest_digest"]
    compiled = {name: state for name, state in b["cache"].items()
                if name.startswith("kernel:") and state != "hit registry"}
    assert compiled == {}, b["cache"]
    assert b["cache"]["base:builder"].startswith("hit registry (base.json only"), b["cache"]
    assert b["cache"]["base:runtime"].startswith("hit registry (base.json only"), b["cache"]
    assert b["cache"]["wheelhouse"].endswith("none downloaded)"), b["cache"]
    assert all(b["cache"][name] == "hit registry" for name in b["cache"] if name.startswith("layer ")), b["cache"]
    assert downloaded(work / "cache-b") == {"wheels": 0, "sources": 0, "debs": 0}
    assert "debootstrap" not in b_log and "WARN" not in b_log, b_log[-3000:]
    assert not b["remote_cache"]["refused"] and not b["remote_cache"]["unavailable"]
