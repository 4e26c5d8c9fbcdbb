"""Engine tier: build images/smoke on the real engine and inspect what a security team would."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest

from build.spec import looks_secret
from tests.conftest import run_build_cli

pytestmark = pytest.mark.engine

SECRET_ENV = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY|CREDENTIAL)=\S+", re.I)


def test_info_prints_the_lock_summary_without_network(engine, smoke_image):
    result = engine.run(smoke_image, ["info"], network="none", timeout=120)
    assert result.exit_code == 0, result.output
    assert "image          smoke" in result.output
    assert "torch          2.13.0+cpu" in result.output
    assert "/etc/ftimage/build.lock.json" in result.output


def test_runs_as_fixed_non_root_user(engine, smoke_image):
    result = engine.run(smoke_image, ["id", "-u"], timeout=60)
    assert result.exit_code == 0
    assert result.output.strip() == "10001"
    info = engine.image(smoke_image)
    assert info["Config"]["User"] == "10001:10001"


def test_labels_lock_and_sbom(engine, smoke_build, smoke_image):
    info = engine.image(smoke_image)
    labels = info["Config"]["Labels"]
    for key in ("org.opencontainers.image.title", "org.opencontainers.image.created",
                "org.opencontainers.image.version", "org.opencontainers.image.base.name"):
        assert labels.get(key), key
    assert labels["io.ftimage.base.id"].startswith("sha256:")
    lock_text = engine.run(smoke_image, ["cat", "/etc/ftimage/build.lock.json"], timeout=60).output
    assert hashlib.sha256(lock_text.encode()).hexdigest() == labels["io.ftimage.lock.sha256"]
    lock = json.loads(lock_text)
    assert lock["image"] == "smoke" and lock["plan_key"] == labels["io.ftimage.plan-key"]
    assert {p["name"] for p in lock["packages"]} >= {"torch", "transformers", "tokenizers"}
    assert lock["base_images"]["runtime"] == labels["io.ftimage.base.id"]
    sbom_inside = json.loads(engine.run(smoke_image, ["cat", "/etc/ftimage/sbom.cdx.json"], timeout=60).output)
    sbom_beside = json.loads((smoke_build["out"] / "sbom.cdx.json").read_text())
    assert sbom_inside == sbom_beside
    names = {c["name"] for c in sbom_inside["components"]}
    assert {p["name"] for p in lock["packages"]} <= names
    # every Debian package of the image (the runtime base's, which the image adds none to) is listed
    listed = engine.run(smoke_image, ["dpkg-query", "-W", "-f", "${db:Status-Status} ${Package} ${Version}\n"],
                        timeout=60).output.split("\n")
    installed = {tuple(line.split()[1:]) for line in listed if line.startswith("installed ")}
    debs = {(c["name"], c["version"]) for c in sbom_inside["components"] if c.get("purl", "").startswith("pkg:deb/")}
    assert len(installed) > 50 and debs == installed, sorted(installed ^ debs)[:20]
    assert (smoke_build["out"] / "build.lock.json").read_text() == lock_text


def test_no_secrets_in_history_labels_or_env(engine, smoke_image):
    info = engine.image(smoke_image)
    texts = [json.dumps(info["Config"].get("Labels") or {}), json.dumps(info["Config"].get("Env") or [])]
    texts += [layer.get("CreatedBy", "") for layer in engine.history(smoke_image)]
    for text in texts:
        assert not SECRET_ENV.search(text), text[:200]
    for key, value in (info["Config"].get("Labels") or {}).items():
        assert not looks_secret(key, value), key
    assert "pip" not in engine.run(smoke_image, ["ls", "/opt/ftimage/venv/bin"], timeout=60).output.split()


def test_runtime_has_no_compiler_on_cpu_image(engine, smoke_image):
    result = engine.run(smoke_image, ["sh", "-c", "command -v gcc cc || echo none"], timeout=60)
    assert result.output.strip() == "none"


def test_report_lists_phases_and_cache_states(smoke_build):
    report = smoke_build["report"]
    assert report["image_id"].startswith("sha256:") and report["size_bytes"] > 0
    assert set(report["phase_seconds"]) >= {"bases", "wheelhouse", "kernels", "render", "image", "check"}
    assert set(report["cache"]) >= {"base:builder", "base:runtime", "wheelhouse", "image"}


def test_second_build_is_all_cache_hits(smoke_build):
    proc = run_build_cli("images/smoke", "--json", "--out", str(smoke_build["out"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["image_id"] == smoke_build["report"]["image_id"]
    assert report["cache"]["image"] == "hit"
    assert report["cache"]["wheelhouse"].startswith("hit")
    assert report["cache"]["base:runtime"] == "hit"


def test_json_logs_are_machine_readable(smoke_build):
    proc = run_build_cli("images/smoke", "--json-logs", "--out", str(smoke_build["out"]))
    assert proc.returncode == 0
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert events and all({"phase", "msg", "t"} <= set(e) for e in events)


def test_a_corrupt_cached_wheel_is_named_evicted_and_refetched_in_the_same_build(smoke_build, tmp_path):
    from build.cache import CacheLayout, default_cache_root
    from contracts import folder_guard
    source = CacheLayout(default_cache_root())
    cache = CacheLayout(tmp_path / "cache")
    shutil.copytree(source.resolutions, cache.resolutions)
    # GBs of wheels and layers: link, don't copy. With the layers there the build assembles nothing,
    # so what it does past the wheelhouse is the same image from the same lock.
    shutil.copytree(source.wheels, cache.wheels, copy_function=os.link)
    shutil.copytree(source.layers, cache.layers, copy_function=os.link)
    shutil.copyfile(source.root / folder_guard.CACHE_MARKER, cache.root / folder_guard.CACHE_MARKER)
    locked = {p["filename"] for p in json.loads((smoke_build["out"] / "build.lock.json").read_text())["packages"]}
    victim = min((p for p in cache.wheels.rglob("*.whl") if p.name in locked), key=lambda p: p.stat().st_size)
    tampered = bytearray(victim.read_bytes())
    tampered[10:18] = b"tampered"
    victim.unlink()                     # break the link first: the real cache must stay intact
    victim.write_bytes(bytes(tampered))
    env = {"FTIMAGE_CACHE": str(cache.root)}
    good = json.loads((smoke_build["out"] / "build.lock.json").read_text())
    locked_sha = {p["filename"]: p["sha256"] for p in good["packages"]}[victim.name]
    proc = run_build_cli("images/smoke", "--json", "--out", str(tmp_path / "out"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]       # repaired within the same build
    (warning,) = [line for line in proc.stderr.splitlines() if "WARN" in line and victim.name in line]
    assert "is damaged" in warning and locked_sha in warning and "downloading it again" in warning
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["cache"]["wheelhouse"].startswith("miss")
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == locked_sha, "the cache holds the good wheel again"
    assert (tmp_path / "out" / "build.lock.json").read_bytes() == (smoke_build["out"] / "build.lock.json").read_bytes()
    assert json.loads(proc.stdout)["image_id"] == smoke_build["report"]["image_id"]


def test_unreachable_engine_is_a_clear_error(tmp_path):
    proc = run_build_cli("images/smoke", "--out", str(tmp_path),
                         env={"DOCKER_HOST": f"unix://{tmp_path}/no-dockerd.sock"}, timeout=120)
    assert proc.returncode == 1
    assert "cannot reach the Docker engine" in proc.stderr
    assert "apt-get install -y docker.io" in proc.stderr and "dockerd" in proc.stderr
    assert "Traceback" not in proc.stderr
