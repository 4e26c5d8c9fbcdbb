"""Engine tier: push the smoke image to a real registry (Debian's docker-registry, distribution
2.8, run here on a free 127.0.0.1 port), pull it back by digest, render a deploy example for
it, and see a push to a registry that is down fail with a clear error."""
from __future__ import annotations

import hashlib
import ipaddress
import json
import shutil
import socket
import subprocess
from pathlib import Path

import docker
import pytest
import yaml

from build.build_report import BuildReport
from build.errors import BuildFailure
from build.oci.image import read_layout
from build.publish.pull_check import NAMESPACE, PullCheck
from build.publish.push import push_image
from build.publish.reference import PushTarget
from contracts.events import EventLog
from tests.conftest import run_build_cli
from tests.fixtures.chat import write_fixture
from tests.fixtures.containers import with_test_env
from tests.fixtures.keys import write_p256_pair
from tests.fixtures.registry import Registry

pytestmark = pytest.mark.engine

LOCK_LABEL = "io.ftimage.lock.sha256"
GATE = "/opt/ftimage/bin/ftimage-gate"


@pytest.fixture(scope="module")
def docker_api():
    return docker.from_env(timeout=600).api


@pytest.fixture(scope="module")
def pushed(smoke_build, registry, docker_api, tmp_path_factory):
    """`python -m build images/smoke --push 127.0.0.1:PORT/ftimage/smoke --sign KEY`, as a user runs it."""
    out = tmp_path_factory.mktemp("pushed-out")
    private, public = write_p256_pair(tmp_path_factory.mktemp("keys"))
    repository = f"{registry.address}/ftimage/smoke"
    proc = run_build_cli("images/smoke", "--out", str(out), "--push", repository, "--sign", str(private))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "build-report.json").read_text())
    yield {"proc": proc, "report": report, "out": out, "repository": repository, "public_key": public}
    for ref in (report["pushed"].get("reference", ""), f"{repository}:{report['tag'].rpartition(':')[2]}"):
        try:
            docker_api.remove_image(ref)
        except docker.errors.APIError:
            pass


def test_push_prints_and_records_the_digest(pushed, smoke_build):
    record = pushed["report"]["pushed"]
    assert record["repository"] == pushed["repository"]
    assert record["digest"].startswith("sha256:") and len(record["digest"]) == 71
    assert record["reference"] == f"{pushed['repository']}@{record['digest']}"
    assert record["tag"] == f"{pushed['repository']}:{smoke_build['tag'].rpartition(':')[2]}"
    assert f"pushed {record['reference']}" in pushed["proc"].stdout
    assert "[     push]" in pushed["proc"].stderr   # progress came from the push stream


def test_the_signed_push_verifies_and_its_attestation_names_the_lock(pushed, smoke_build):
    record = pushed["report"]["pushed"]
    assert record["signature"] == f"{pushed['repository']}:sha256-{record['digest'][7:]}.sig"
    assert record["attestation"] == f"{pushed['repository']}:sha256-{record['digest'][7:]}.att"
    assert record["signed_by"].startswith("sha256:")
    proc = run_build_cli("verify-image", record["reference"], "--key", str(pushed["public_key"]), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["check"]: r for r in json.loads(proc.stdout)["rows"]}
    assert [r["status"] for r in rows.values()] == ["PASS"] * 4, rows
    assert smoke_build["report"]["lock_sha256"][:16] in rows["lock"]["detail"]
    # the tag the build pushed resolves to the same, signed digest
    by_tag = run_build_cli("verify-image", record["tag"], "--key", str(pushed["public_key"]))
    assert by_tag.returncode == 0 and record["digest"] in by_tag.stdout, by_tag.stdout + by_tag.stderr


def test_pull_by_digest_gives_back_the_same_lock(pushed, docker_api, smoke_build):
    record = pushed["report"]["pushed"]
    # the push leaves no REGISTRY/REPO tag behind, so this pull can only come from the registry
    assert not docker_api.images(name=record["tag"])
    clean = f"ftimage-registry-test/smoke:{record['digest'][7:19]}"
    try:
        for _ in docker_api.pull(record["reference"], stream=True, decode=True):
            pass
        docker_api.tag(record["reference"], *clean.split(":"))
        labels = docker_api.inspect_image(clean)["Config"]["Labels"]
        assert labels[LOCK_LABEL] == smoke_build["report"]["lock_sha256"]
        assert record["reference"] in docker_api.inspect_image(clean)["RepoDigests"]
    finally:
        try:
            docker_api.remove_image(clean)
        except docker.errors.APIError:
            pass


def test_deploy_example_pins_the_pushed_digest(pushed):
    proc = run_build_cli("images/smoke", "--deploy-example", "k8s", "--out", str(pushed["out"]))
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load(proc.stdout)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["image"] == pushed["report"]["pushed"]["reference"]


def test_gate_runs_under_the_k8s_security_context(pushed, engine, smoke_image):
    """What the rendered pod runs, with its restrictions: read-only root, /tmp a volume, no
    capabilities, no privilege escalation. The smoke image has no fused kernels, so the gate
    refuses (exit 3) unless the override is given."""
    client = docker.from_env(timeout=600)
    settings = dict(entrypoint=[GATE], read_only=True, tmpfs={"/tmp": ""}, environment=with_test_env({"HOME": "/tmp"}),
                    cap_drop=["ALL"], security_opt=["no-new-privileges"], network_mode="none", user="10001")
    refused = client.containers.run(smoke_image, ["--", "id", "-u"], detach=True, **settings)
    try:
        assert refused.wait(timeout=300)["StatusCode"] == 3
        assert "verify did not pass" in refused.logs().decode()
    finally:
        refused.remove(force=True)
    settings["environment"]["FTIMAGE_ALLOW_FALLBACK"] = "1"
    allowed = client.containers.run(smoke_image, ["--", "id", "-u"], detach=True, **settings)
    try:
        assert allowed.wait(timeout=300)["StatusCode"] == 0
        assert allowed.logs(stderr=False).decode().strip() == "10001"
    finally:
        allowed.remove(force=True)


# ---- the pushed image read by the other runtimes a cluster uses ---------------------------------------
# Kubernetes nodes pull through containerd's CRI, not dockerd: containerd (the one dockerd runs, in a
# namespace of its own here) must see the manifest digest and diffIDs the build recorded, and run the
# image with runc. skopeo copies it between a registry and an OCI layout without changing its digest.
CONTAINERD = ["ctr", "--address", "/run/docker/containerd/containerd.sock", "--namespace", "ftimage-test"]


def ctr(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CONTAINERD, *args], capture_output=True, text=True, timeout=timeout)


def ctr_json(digest: str) -> dict:
    done = ctr("content", "get", digest)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def in_containerd(pushed):
    """The pushed image, pulled by digest into containerd (plain HTTP: the registry is on loopback)."""
    reference = pushed["report"]["pushed"]["reference"]
    done = ctr("images", "pull", "--plain-http", reference)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    yield reference
    ctr("images", "rm", reference)


def test_containerd_pulls_the_pushed_image_with_the_recorded_digest_and_diff_ids(in_containerd, pushed):
    record, report = pushed["report"]["pushed"], pushed["report"]
    listed = ctr("images", "ls")
    line = next(row for row in listed.stdout.splitlines() if row.startswith(in_containerd))
    assert record["digest"] in line.split(), line
    manifest = ctr_json(record["digest"])
    config = ctr_json(manifest["config"]["digest"])
    assert config["rootfs"]["diff_ids"] == report["diff_ids"]
    assert report["manifest_digest"] == record["digest"]


@pytest.mark.parametrize("command, expected", [
    (["info"], 0),
    (["verify", "--device", "cpu", "--checks", "environment,dispatch"], 2),   # the CPU image fails closed
])
def test_containerd_runs_the_image_with_runc(in_containerd, command, expected):
    name = f"ftimage-test-{command[0]}"
    ctr("containers", "rm", name)
    done = ctr("run", "--rm", "--env", "OMP_NUM_THREADS=1", in_containerd, name,
               "/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint", *command, timeout=900)
    assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    if command == ["info"]:
        assert "torch" in done.stdout


def test_containerd_runs_a_one_step_finetune_on_a_read_only_root(in_containerd, tmp_path):
    """finetune under runc as containerd starts it: the image's user, a read-only root, /tmp a tmpfs,
    the job's volume bind-mounted: a checkpoint and the final export."""
    fx = write_fixture(tmp_path / "fx", n_rows=32, mount_root="/fx",
                       config_overrides={"train.max_steps": 1, "checkpoint.every": 1})
    for path in [fx.root, *fx.root.rglob("*")]:        # the job's volume, writable by the image's uid
        path.chmod(0o777 if path.is_dir() else 0o666)
    name = "ftimage-test-finetune"
    ctr("containers", "rm", name)
    done = ctr("run", "--rm", "--read-only", "--env", "OMP_NUM_THREADS=1",
               "--mount", f"type=bind,src={fx.root},dst=/fx,options=rbind:rw",
               "--mount", "type=tmpfs,src=tmpfs,dst=/tmp,options=nosuid:nodev:size=268435456",
               in_containerd, name, "/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint", "finetune",
               "--config", "/fx/config.yaml", "--allow-fallback", timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = fx.root / "out"
    assert json.loads((out / "run_report.json").read_text())["allow_fallback"] is True
    assert (out / "final" / "model.safetensors").is_file() and "Traceback" not in done.stdout + done.stderr


def test_push_with_check_pull_fails_with_containerds_reason_for_a_manifest_it_refuses(in_containerd, pushed,
                                                                                       registry, tmp_path):
    """A manifest the registry stores and containerd refuses: the pushed image's own config and
    blobs, its last layer left out of the manifest while the config still lists that layer's
    diff_id. The push (from a layout holding that manifest, the build's own push path) with
    `--check-pull containerd` fails with containerd's reason, and records nothing."""
    layout = Path(pushed["report"]["layout"])
    manifest, config, _ = read_layout(layout)
    broken = json.loads(manifest)
    broken["layers"].pop()
    assert len(broken["layers"]) < len(json.loads(config)["rootfs"]["diff_ids"])
    copy = tmp_path / "broken-layout"
    blobs = copy / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    shutil.copy(layout / "oci-layout", copy / "oci-layout")
    for entry in [broken["config"], *broken["layers"]]:
        (blobs / entry["digest"][7:]).symlink_to(layout / "blobs" / "sha256" / entry["digest"][7:])
    data = json.dumps(broken).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (blobs / digest[7:]).write_bytes(data)
    (copy / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": broken["mediaType"], "digest": digest, "size": len(data)}]}))
    target = PushTarget(registry.address, "ftimage/smoke", PullCheck("containerd", CONTAINERD[2]))
    report = BuildReport(image="smoke", tag="smoke:not-for-containerd", layout=str(copy))
    with pytest.raises(BuildFailure) as raised:
        push_image(report, target, out_dir=tmp_path / "out", log=EventLog(quiet=True))
    shown = raised.value.render()     # what the CLI prints
    assert shown.splitlines()[0] == (f"error: containerd refused to pull {pushed['repository']}@{digest}: "
                                     "mismatched image rootfs and manifest layers"), shown
    assert "Traceback" not in shown and not (tmp_path / "out" / "build-report.json").exists()
    # the registry took it: only containerd's pull could tell
    stored = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                             f"docker://{pushed['repository']}@{digest}"], capture_output=True, timeout=300)
    assert stored.returncode == 0 and stored.stdout == data, stored.stderr[-2000:]
    left = subprocess.run(["ctr", "--address", CONTAINERD[2], "--namespace", NAMESPACE, "images", "ls", "-q"],
                          capture_output=True, text=True, timeout=60)
    assert left.returncode == 0 and f"@{digest}" not in left.stdout, left.stdout + left.stderr


def test_skopeo_copies_the_pushed_image_to_a_layout_and_back_with_the_same_digest(pushed, tmp_path):
    record = pushed["report"]["pushed"]
    layout = f"oci:{tmp_path / 'layout'}:copied"
    back = f"{pushed['repository']}:skopeo-roundtrip"
    for source, dest in ((f"docker://{record['reference']}", layout), (layout, f"docker://{back}")):
        done = subprocess.run(["skopeo", "copy", "--preserve-digests", "--src-tls-verify=false",
                               "--dest-tls-verify=false", source, dest], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{back}"],
                         capture_output=True, timeout=300)
    assert raw.returncode == 0, raw.stderr[-2000:]
    assert "sha256:" + hashlib.sha256(raw.stdout).hexdigest() == record["digest"]


# podman (CRI-O's and OpenShift's image library and runtime) pulls from the same registry. Two
# facts of this machine shape the flags: crun 1.8.1 refuses its hybrid cgroup layout ("cgroups in
# hybrid mode not supported"), so podman runs runc here; and podman as root raises RLIMIT_NOFILE and
# RLIMIT_NPROC past what this sandbox lets a container init set, so the test lowers both.
PODMAN_RUN = ["podman", "run", "--rm", "--network", "none", "--runtime", "runc", "--ulimit", "nofile=4096:4096",
              "--ulimit", "nproc=4096:4096", "--env", "OMP_NUM_THREADS=1"]


@pytest.fixture(scope="module")
def in_podman(pushed):
    reference = pushed["report"]["pushed"]["reference"]
    done = subprocess.run(["podman", "pull", "--tls-verify=false", reference], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    yield reference
    subprocess.run(["podman", "rmi", "-f", reference], capture_output=True, timeout=300)


def test_podman_pulls_the_pushed_image_with_the_recorded_digest_and_diff_ids(in_podman, pushed):
    done = subprocess.run(["podman", "image", "inspect", in_podman], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)[0]
    assert info["Digest"] == pushed["report"]["pushed"]["digest"]
    assert info["RootFS"]["Layers"] == pushed["report"]["diff_ids"]


# The pulled image runs; the conditions clusters run it under (any uid, no passwd entry, a read-only
# root, no home, no ENTRYPOINT) are test_any_uid.py's matrix, under dockerd and podman alike.
@pytest.mark.parametrize("command, expected", [
    (["info"], 0),
    (["verify", "--device", "cpu", "--checks", "environment,dispatch"], 2),   # the CPU image fails closed
])
def test_podman_runs_the_image(in_podman, command, expected):
    done = subprocess.run([*PODMAN_RUN, in_podman, *command], capture_output=True, text=True, timeout=900)
    assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr


def bridge_gateway(docker_api) -> str | None:
    """The host's address on dockerd's default bridge (docker0): reachable by dockerd, not loopback."""
    for config in docker_api.inspect_network("bridge")["IPAM"]["Config"] or []:
        try:
            network = ipaddress.ip_network(config.get("Subnet", ""))
        except ValueError:
            continue
        address = config.get("Gateway") or (str(network[1]) if network.version == 4 else "")
        if not address:
            continue
        try:
            with socket.socket() as sock:
                sock.bind((address, 0))
            return address
        except OSError:
            continue
    return None


def test_plain_http_registry_off_loopback_names_insecure_registries(smoke_build, docker_api, tmp_path):
    """dockerd talks HTTPS to any registry outside 127.0.0.0/8: the error says what to configure."""
    gateway = bridge_gateway(docker_api)
    if gateway is None:
        pytest.skip("no IPv4 address of dockerd's default bridge to serve a non-loopback registry on")
    off_loopback = Registry(tmp_path / "registry", host=gateway)
    try:
        proc = run_build_cli("images/smoke", "--out", str(tmp_path / "out"), "--push",
                             f"{off_loopback.address}/ftimage/smoke")
    finally:
        off_loopback.stop()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: push to {off_loopback.address} failed: " in proc.stderr
    assert "insecure-registries" in proc.stderr and "Traceback" not in proc.stderr


def test_push_to_a_stopped_registry_fails_clearly(pushed, registry, tmp_path):
    """Last in this module: it stops the module's registry."""
    registry.stop()
    proc = run_build_cli("images/smoke", "--out", str(tmp_path / "out"), "--push", pushed["repository"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: push to {registry.address} failed: " in proc.stderr
    assert "connection refused" in proc.stderr.lower() and "fix: nothing answers at" in proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads((tmp_path / "out" / "build-report.json").read_text())
    assert not report["pushed"]
