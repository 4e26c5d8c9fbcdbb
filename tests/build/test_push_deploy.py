"""--push reference checks, the push library against a scripted registry client, and
--deploy-example rendering from a build report: all without an engine or a registry."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from build.build_report import BuildReport
from build.errors import BuildFailure
from build.publish.pull_check import NAMESPACE, pull_check_from_args
from build.publish.push import push_image
from build.publish.reference import PushTarget
from build.resolve import load_plan
from build.spec import MANIFEST_PATH, REPO_ROOT
from contracts.events import EventLog

pytestmark = pytest.mark.unit

SMOKE = str(REPO_ROOT / "images" / "smoke")
GATE = "/opt/ftimage/bin/ftimage-gate"
DIGEST = "sha256:" + "ab" * 32
REPOSITORY = "registry.example.com:5000/team/smoke"


@pytest.fixture(scope="module")
def smoke_tag() -> str:
    return load_plan(Path(SMOKE), MANIFEST_PATH).tag


# ---- --push REGISTRY/REPO: refused before any build work ----------------------------------

@pytest.mark.parametrize("value, field, words", [
    ("http://registry.example.com/team/smoke", "registry", "URL scheme"),
    ("https://registry.example.com/team/smoke", "registry", "URL scheme"),
    ("registry.example.com/Team/Smoke", "repository", "uppercase"),
    (f"registry.example.com/team/smoke:v1@{DIGEST}", "reference", "a tag AND a digest"),
    (f"registry.example.com/team/smoke@{DIGEST}", "digest", "is a digest"),
    ("registry.example.com/team/smoke:v1", "tag", "the build chooses the tag"),
    ("", "reference", "is empty"),
    ("registry.example.com//smoke", "repository", "empty part"),
    ("registry.example.com/team/", "repository", "empty part"),
    ("registry.example.com/team/$(id)", "reference", "characters no Docker reference holds"),
    ("registry.example.com/team/smoke\n", "reference", "characters no Docker reference holds"),
    ("team/smoke", "registry", "names no registry"),
    ("registry.example.com:5000", "repository", "no repository"),
    ("registry.example.com:70000/team/smoke", "registry", "out of range"),
    ("registry.example.com/team-/smoke", "repository", "not a Docker repository path component"),
    ("registry.example.com/team/smoke#main", "reference", "has a query or fragment ('#')"),
    ("registry.example.com/team/smoke?x=1", "reference", "has a query or fragment ('?')"),
    ("ci-bot:hunter2@registry.example.com/team/smoke", "reference", "carries credentials or a token"),
])
def test_bad_push_reference_is_exit_2_before_any_build_work(run_cli, value, field, words):
    # the image folder does not exist: a spec error would come first if the plan were loaded first
    code, out, err = run_cli(["images/no-such-image", "--push", value])
    assert code == 2, err
    assert err.startswith("error: the --push reference has"), err
    assert f"--push: {field}: " in err and words in err, err
    assert "fix: " in err and "Traceback" not in err and out == ""
    assert "hunter2" not in err
    if "credentials" not in words:     # a malformed reference is not reported as a secret
        assert "credentials" not in err, err


@pytest.mark.parametrize("value", ["127.0.0.1:5000/ftimage/smoke", "localhost/smoke", "docker.io/team/smoke",
                                   "registry.example.com:5000/a/b/c", "[::1]:5000/team/smoke"])
def test_good_push_reference_passes_the_check(run_cli, value):
    code, _, err = run_cli(["images/no-such-image", "--push", value])
    assert code == 2 and "--push" not in err and "images/no-such-image" in err, err  # the spec is next


@pytest.mark.parametrize("mode", [["--plan"], ["--kernels-only"], ["--deploy-example", "k8s"]])
def test_push_with_a_mode_that_builds_nothing_is_refused(run_cli, mode):
    code, _, err = run_cli([SMOKE, "--push", REPOSITORY, *mode])
    assert code == 2 and f"and {mode[0]} builds none" in err and "fix: " in err, err


# ---- the push, against a scripted client ---------------------------------------------------

class ScriptedRegistry:
    """A PushClient that plays back a push stream, as dockerd would send it."""

    def __init__(self, stream: list[dict], repo_digests: list[str] | None = None):
        self.stream, self.digests = stream, repo_digests or []
        self.calls: list[tuple] = []

    def tag(self, image, repository, tag):
        self.calls.append(("tag", image, f"{repository}:{tag}"))

    def push(self, repository, tag):
        self.calls.append(("push", f"{repository}:{tag}"))
        yield from self.stream

    def repo_digests(self, image):
        return self.digests

    def untag(self, reference):
        self.calls.append(("untag", reference))


def _report(tag: str = "smoke:0123456789ab") -> BuildReport:
    return BuildReport(image="smoke", tag=tag, image_id="sha256:" + "cd" * 32)


def _push(tmp_path, client, target=PushTarget("127.0.0.1:5000", "ftimage/smoke")):
    report = _report()
    record = push_image(report, target, out_dir=tmp_path, log=EventLog(quiet=True), client=client)
    return report, record


def test_push_records_the_digest_atomically(tmp_path):
    client = ScriptedRegistry([
        {"status": "The push refers to repository [127.0.0.1:5000/ftimage/smoke]"},
        {"status": "Preparing", "progressDetail": {}, "id": "aaa"},
        {"status": "Pushing", "progressDetail": {"current": 1 << 20, "total": 4 << 20}, "id": "aaa"},
        {"status": "Pushed", "progressDetail": {}, "id": "aaa"},
        {"status": "Layer already exists", "progressDetail": {}, "id": "bbb"},
        {"status": f"0123456789ab: digest: {DIGEST} size: 1576"},
        {"progressDetail": {}, "aux": {"Tag": "0123456789ab", "Digest": DIGEST, "Size": 1576}},
    ])
    report, record = _push(tmp_path, client)
    assert record.reference == f"127.0.0.1:5000/ftimage/smoke@{DIGEST}"
    saved = json.loads((tmp_path / "build-report.json").read_text())
    assert saved["pushed"] == {"repository": "127.0.0.1:5000/ftimage/smoke", "digest": DIGEST,
                               "tag": "127.0.0.1:5000/ftimage/smoke:0123456789ab", "reference": record.reference}
    assert report.render().endswith(f"pushed {record.reference}")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    remote = "127.0.0.1:5000/ftimage/smoke:0123456789ab"
    # the image is pushed under its own tag, and the extra local tag goes once the digest is known
    assert client.calls == [("tag", report.image_id, remote), ("push", remote), ("untag", remote)]


def test_digest_falls_back_to_repo_digests(tmp_path):
    client = ScriptedRegistry([{"status": "Pushed", "id": "aaa"}],
                              repo_digests=[f"other.example.com/x@sha256:{'00' * 32}",
                                            f"127.0.0.1:5000/ftimage/smoke@{DIGEST}"])
    _, record = _push(tmp_path, client)
    assert record.digest == DIGEST


def test_push_without_a_digest_is_a_failure(tmp_path):
    with pytest.raises(BuildFailure, match="returned no sha256 digest"):
        _push(tmp_path, ScriptedRegistry([{"status": "Pushed", "id": "aaa"}]))
    assert not (tmp_path / "build-report.json").exists()


@pytest.mark.parametrize("message, fix_words", [
    ('Get "http://127.0.0.1:5000/v2/": dial tcp 127.0.0.1:5000: connect: connection refused',
     "start the registry"),
    ('Get "https://10.0.0.5:5000/v2/": http: server gave HTTP response to HTTPS client', "insecure-registries"),
    ("unauthorized: authentication required", "docker login 127.0.0.1:5000"),
    ("denied: requested access to the resource is denied", "docker login"),
    ("name unknown: repository name not known to registry", "create it there"),
    ("x509: certificate signed by unknown authority", "/etc/docker/certs.d/127.0.0.1:5000/ca.crt"),
    ("something new and strange", "docker push"),
])
def test_push_errors_arrive_in_the_stream_and_name_the_registry(tmp_path, message, fix_words):
    client = ScriptedRegistry([{"status": "Preparing", "id": "aaa"},
                               {"errorDetail": {"message": message}, "error": message}])
    with pytest.raises(BuildFailure) as raised:
        _push(tmp_path, client)
    assert str(raised.value).startswith("push to 127.0.0.1:5000 failed: ")
    assert fix_words in raised.value.fix
    assert client.calls[-1] == ("untag", "127.0.0.1:5000/ftimage/smoke:0123456789ab")
    assert not (tmp_path / "build-report.json").exists()


# ---- --check-pull containerd: containerd pulls what was pushed (for real: tests/engine/test_registry.py) ----
@pytest.fixture
def containerd(tmp_path, monkeypatch):
    """A `ctr` stub on PATH (it logs its argv; `images pull` prints CTR_ERROR and exits 1 when that is
    set) and a socket to name: (the socket's path, the log)."""
    stubs = tmp_path / "ctr-stub"
    stubs.mkdir()
    log = tmp_path / "ctr-calls"
    (stubs / "ctr").write_text(f"""#!/bin/bash
echo "$*" >> {log}
case "$*" in *"images pull"*) [ -n "$CTR_ERROR" ] && {{ printf '%s\\n' "$CTR_ERROR" >&2; exit 1; }} ;; esac
exit 0
""")
    (stubs / "ctr").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    monkeypatch.delenv("CTR_ERROR", raising=False)
    socket_path = tmp_path / "containerd.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(socket_path))
    return socket_path, log


@pytest.mark.parametrize("argv, words", [
    (["--check-pull", "containerd"], "there is no --push"),
    (["--push", REPOSITORY, "--check-pull", "podman"], "'podman' is not a runtime it can pull with"),
    (["--push", REPOSITORY, "--check-pull", "containerd=/no/such.sock"], "'/no/such.sock' is not a socket here"),
])
def test_check_pull_it_cannot_run_is_exit_2_before_any_build_work(run_cli, containerd, argv, words):
    code, out, err = run_cli(["images/no-such-image", *argv])      # the spec would fail next
    assert code == 2 and err.startswith("error: --check-pull has") and words in err and "fix: " in err, err
    assert "images/no-such-image" not in err and out == ""


def test_check_pull_passes_and_removes_what_it_pulled(tmp_path, containerd):
    socket_path, log = containerd
    check = pull_check_from_args(f"containerd={socket_path}", push=True)
    _, record = _push(tmp_path, _streamed_digest(), PushTarget("127.0.0.1:5000", "ftimage/smoke", check))
    ctr = f"--address {socket_path} --namespace {NAMESPACE}"
    assert log.read_text().splitlines() == [f"{ctr} images pull --plain-http {record.reference}",
                                            f"{ctr} images rm {record.reference}"]
    assert json.loads((tmp_path / "build-report.json").read_text())["pushed"]["digest"] == DIGEST


def test_a_manifest_containerd_refuses_fails_the_push_with_its_reason_and_records_nothing(tmp_path, containerd,
                                                                                       monkeypatch):
    socket_path, log = containerd
    monkeypatch.setenv("CTR_ERROR", 'time="2024-01-01T00:00:00Z" level=info msg="fetching"\n'
                                    "ctr: mismatched image rootfs and manifest layers")
    target = PushTarget("127.0.0.1:5000", "ftimage/smoke", pull_check_from_args(f"containerd={socket_path}", push=True))
    with pytest.raises(BuildFailure) as raised:
        _push(tmp_path, _streamed_digest(), target)
    assert str(raised.value) == (f"containerd refused to pull 127.0.0.1:5000/ftimage/smoke@{DIGEST}: "
                                 "mismatched image rootfs and manifest layers")
    assert "ctr images pull" in raised.value.fix
    assert "images rm" in log.read_text()                   # nothing left in containerd
    assert not (tmp_path / "build-report.json").exists()    # a refused image is not recorded (nor signed)


def _streamed_digest() -> ScriptedRegistry:
    return ScriptedRegistry([{"status": "Pushed", "id": "aaa"}, {"aux": {"Tag": "0123456789ab", "Digest": DIGEST}}])


# ---- --deploy-example KIND (the Trainer v2 ones: test_trainer_v2.py) -----------------------

def _write_report(out: Path, tag: str, pushed: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    report = {"image": "smoke", "tag": tag, "pushed": pushed or {}}
    (out / "build-report.json").write_text(json.dumps(report))
    return out


def _pushed(**changes) -> dict:
    record = {"repository": REPOSITORY, "tag": f"{REPOSITORY}:0123456789ab", "digest": DIGEST,
              "reference": f"{REPOSITORY}@{DIGEST}"}
    return {**record, **changes}


@pytest.fixture
def pushed_out(tmp_path, smoke_tag) -> Path:
    return _write_report(tmp_path / "out", smoke_tag, _pushed())


def _render(run_cli, out: Path, kind: str):
    return run_cli([SMOKE, "--deploy-example", kind, "--out", str(out)])


def test_k8s_example_pins_the_digest_and_hardens_the_pod(run_cli, pushed_out):
    from contracts.finetune_config import FinetuneConfig
    from entrypoint.launcher.torchrun import resolve_topology

    code, out, err = _render(run_cli, pushed_out, "k8s")
    assert code == 0, err
    job = yaml.safe_load(out)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    for role in ("Master", "Worker"):
        pod = specs[role]["template"]["spec"]
        container = pod["containers"][0]
        assert container["name"] == "pytorch"
        assert container["image"] == f"{REPOSITORY}@{DIGEST}"
        # `command:` bypasses the ENTRYPOINT: finetune, which runs verify itself, is named explicitly
        assert container["command"][:5] == ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint", "finetune"]
        assert "args" not in container and "/bin/sh" not in out and "sh -c" not in out
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        assert container["securityContext"] == {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                                "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/out", "/dev/shm"} <= mounts
    # what the launcher makes of a pod's environment: one c10d rendezvous for all the pods
    env = {e["name"]: e["value"] for e in specs["Worker"]["template"]["spec"]["containers"][0]["env"]}
    nodes = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    assert env["NNODES"] == str(nodes)
    cfg = FinetuneConfig()
    cfg.launch.nproc_per_node = 8
    topo = resolve_topology(cfg, env)
    assert (topo.nnodes, topo.rdzv, topo.rdzv_endpoint) == (nodes, "c10d", f"{job['metadata']['name']}-master-0:29400")


def test_k8s_example_shows_a_user_trainer_behind_the_gate(run_cli, pushed_out):
    code, out, _ = _render(run_cli, pushed_out, "k8s")
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   command: "))
    block = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        block.append(line[4:])
    command = yaml.safe_load("\n".join(block))["command"]
    assert command[0] == GATE and "--" in command
    assert command[command.index("--") + 1] == "/opt/ftimage/venv/bin/torchrun"


# srun, stubbed: it records each call's argv (and whether a task's own variables reached it), then
# exits as srun does, with the highest exit code of the step's tasks. VERIFY_EXITS holds each
# node's exit code for the verify step (the gate in front of /bin/true); every other step exits 0.
SRUN_STUB = """#!/bin/bash
printf "%s\\n" "$@" >> "$SRUN_ARGS"
echo "--- end" >> "$SRUN_ARGS"
echo "${SLURM_NODEID-unset} ${SLURM_PROCID-unset}" > "$SRUN_ARGS.ids"
highest=0
if [ "${@: -1}" = /bin/true ]; then
  for code in ${VERIFY_EXITS:-0 0}; do [ "$code" -gt "$highest" ] && highest=$code; done
fi
exit $highest
"""


def _stubs(folder: Path) -> Path:
    """srun and scontrol stubs (two nodes, node-a and node-b) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "srun").write_text(SRUN_STUB)
    (folder / "scontrol").write_text("#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\n")
    for stub in folder.iterdir():
        stub.chmod(0o755)
    return folder


def _srun_calls(args: Path) -> list[list[str]]:
    calls = args.read_text().split("--- end\n")[:-1] if args.exists() else []
    return [call.splitlines() for call in calls]


def _run_sbatch(tmp_path: Path, script: str, **env) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run the rendered pyxis script with srun and scontrol stubbed; return each srun call's argv."""
    stubs = _stubs(tmp_path / "stubs")
    (tmp_path / "job.sbatch").write_text(script)
    args = tmp_path / "srun-args"
    run_env = {"PATH": f"{stubs}:{os.environ['PATH']}", "SRUN_ARGS": str(args), "SLURM_JOB_NODELIST": "node-[a-b]",
               "SLURM_JOB_NAME": "ftimage-sft", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
               "OUT": str(tmp_path / "run"), "HOME": str(tmp_path), **env}
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=run_env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    return proc, _srun_calls(args)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_example_pins_the_digest_and_gates_a_user_trainer(run_cli, pushed_out, tmp_path):
    code, script, err = _render(run_cli, pushed_out, "slurm")
    assert code == 0, err
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "bash -c" not in script and "sh -c" not in script
    assert "\n#SBATCH --no-requeue\n" in script      # a node failure ends the job: resubmitting resumes
    # pyxis/enroot spell the registry with '#'
    image = f"--container-image=registry.example.com:5000#team/smoke@{DIGEST}"

    proc, (verify, finetune) = _run_sbatch(tmp_path / "finetune", script)
    assert proc.returncode == 0, proc.stderr
    # every node's verify in a step of its own first (no --kill-on-bad-exit: the passing nodes exit 0)
    assert image in verify and "--no-container-remap-root" in verify and "--kill-on-bad-exit=1" not in verify
    assert verify[-3:] == [GATE, "--", "/bin/true"]
    assert image in finetune and "--no-container-remap-root" in finetune and "--kill-on-bad-exit=1" in finetune
    command = finetune[finetune.index("--container-env=MASTER_ADDR,MASTER_PORT,HOME") + 1:]
    assert command[:6] == ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint", "finetune", "--config"]

    proc, (verify, trainer) = _run_sbatch(tmp_path / "trainer", script, TRAIN_SCRIPT=str(tmp_path / "train.py"))
    assert proc.returncode == 0, proc.stderr
    assert verify[-5:] == [GATE, "--model", "/models/Qwen3.5-27B", "--", "/bin/true"]
    command = trainer[trainer.index("--container-env=MASTER_ADDR,MASTER_PORT,HOME") + 1:]
    assert command[:4] == [GATE, "--model", "/models/Qwen3.5-27B", "--"]
    assert command[4] == "/opt/ftimage/venv/bin/torchrun" and command[-1] == "/code/train.py"
    assert "--rdzv-endpoint=node-a:29400" in command and image in trainer


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None, reason="needs bash, python3")
@pytest.mark.parametrize("kind", ["slurm", "slurm-oci"])
@pytest.mark.parametrize("trainer", [False, True], ids=["finetune", "user-trainer"])
def test_slurm_one_node_failing_verify_ends_the_job_with_3_before_any_training_step(run_cli, pushed_out, tmp_path,
                                                                                    kind, trainer):
    """node-b's verify exits 3, node-a's passes: srun reports the step's highest code, and the job
    ends with it before the training step starts. Inside the training step the same failure would
    be hidden behind the nodes stopped while they waited for node-b in the rendezvous (143)."""
    extra = {"TRAIN_SCRIPT": str(tmp_path / "shared" / "train.py")} if trainer else {}
    if kind == "slurm":
        code, script, err = _render(run_cli, pushed_out, kind)
        assert code == 0, err
        proc, calls = _run_sbatch(tmp_path, script, VERIFY_EXITS="0 3", **extra)
    else:
        script, shared, made = _oci_bundle(tmp_path, run_cli, pushed_out)
        assert made["proc"].returncode == 0, made["proc"].stderr
        proc, calls = _run_oci_sbatch(tmp_path, script, shared / "smoke.bundle", VERIFY_EXITS="0 3", **extra)
    assert proc.returncode == 3, proc.stderr
    assert len(calls) == 1 and calls[0][-1] == "/bin/true" and GATE in calls[0], calls   # the verify step only
    passing, _ = (_run_sbatch(tmp_path / "passing", script, **extra) if kind == "slurm" else
                  _run_oci_sbatch(tmp_path, script, shared / "smoke.bundle", **extra))
    assert passing.returncode == 0, passing.stderr     # the same script trains once every node passes


# ---- slurm-oci: Slurm's own OCI containers (run for real on a cluster: tests/engine/test_slurm_cluster.py) ----
UMOCI_CONFIG = {   # what `umoci unpack --rootless` writes, cut to the fields the bundle step changes
    "process": {"user": {"uid": 10001, "gid": 10001}, "args": ["/opt/ftimage/venv/bin/python", "-I", "-m"],
                "env": ["PATH=/opt/ftimage/venv/bin:/usr/bin:/bin"], "cwd": "/workspace",
                "capabilities": {"bounding": ["CAP_KILL"], "effective": ["CAP_KILL"]},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}], "noNewPrivileges": True},
    "root": {"path": "rootfs"}, "hostname": "umoci-default",
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
               {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["size=65536k"]}],
    "linux": {"uidMappings": [{"containerID": 0, "hostID": 1000, "size": 1}],
              "namespaces": [{"type": "pid"}, {"type": "uts"}, {"type": "mount"}, {"type": "user"}]},
}


def _oci_bundle(tmp_path: Path, run_cli, pushed_out, digest: str = DIGEST) -> tuple[str, Path, dict]:
    """The rendered script and a bundle made by its own `bundle` mode, skopeo and umoci stubbed."""
    code, script, err = _render(run_cli, pushed_out, "slurm-oci")
    assert code == 0, err
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    # skopeo: write the copied digest where --digestfile says; umoci: unpack = write a config.json
    (stubs / "skopeo").write_text(f'#!/bin/bash\nwhile [ "$1" != --digestfile ]; do shift; done\n'
                                  f'printf %s "{digest}" > "$2"\necho "$@" > "$SKOPEO_ARGS"\n')
    (stubs / "umoci").write_text(f"#!/bin/bash\nmkdir -p \"${{@: -1}}/rootfs\"\n"
                                 f"echo '{json.dumps(UMOCI_CONFIG)}' > \"${{@: -1}}/config.json\"\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    shared = tmp_path / "shared"
    env = {"PATH": f"{stubs}:{os.environ['PATH']}", "BUNDLE": str(shared / "smoke.bundle"), "SHARED_DIRS": str(shared),
           "SKOPEO_ARGS": str(tmp_path / "skopeo-args"), "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch"), "bundle"], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    return script, shared, {"proc": proc, "env": env}


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None, reason="needs bash, python3")
def test_slurm_oci_bundle_is_the_pinned_digest_made_for_slurm(run_cli, pushed_out, tmp_path):
    script, shared, made = _oci_bundle(tmp_path, run_cli, pushed_out)
    assert made["proc"].returncode == 0, made["proc"].stderr
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert f"docker://{REPOSITORY}@{DIGEST}" in (tmp_path / "skopeo-args").read_text()   # pinned by digest
    bundle = shared / "smoke.bundle"
    spec = json.loads((bundle / "config.json").read_text())
    assert spec["process"]["user"] == {"uid": 0, "gid": 0}       # umoci --rootless maps only the user, to 0
    assert all(caps == [] for caps in spec["process"]["capabilities"].values()) and spec["process"]["noNewPrivileges"]
    assert "rlimits" not in spec["process"] and "hostname" not in spec and spec["root"]["readonly"] is True
    assert [ns["type"] for ns in spec["linux"]["namespaces"]] == ["pid", "mount", "user"]   # the node's host name
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert mounts["/tmp"]["type"] == mounts["/dev/shm"]["type"] == "tmpfs"
    assert not any(o.startswith("size=") for o in mounts["/dev/shm"]["options"])
    assert mounts["/etc/hosts"]["source"] == "/etc/hosts" and "ro" in mounts["/etc/hosts"]["options"]
    assert mounts[str(shared)]["source"] == str(shared)             # SHARED_DIRS at the same path
    assert (bundle / "ftimage-digest").read_text().strip() == DIGEST
    assert (bundle / "ftimage-binds").read_text().split() == [str(shared)]
    again = subprocess.run(["bash", str(tmp_path / "job.sbatch"), "bundle"], env=made["env"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr      # never unpacked over an old bundle


def test_slurm_oci_bundle_of_another_digest_is_refused(run_cli, pushed_out, tmp_path):
    _, shared, made = _oci_bundle(tmp_path, run_cli, pushed_out, digest="sha256:" + "cd" * 32)
    assert made["proc"].returncode == 2, made["proc"].stderr
    assert f"not the pinned {DIGEST}" in made["proc"].stderr and not (shared / "smoke.bundle").exists()


def test_slurm_oci_bundle_with_a_relative_shared_dir_is_refused_and_left_unmade(run_cli, pushed_out, tmp_path):
    script, shared, made = _oci_bundle(tmp_path, run_cli, pushed_out)
    env = {**made["env"], "SHARED_DIRS": "shared", "BUNDLE": str(shared / "other.bundle")}
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch"), "bundle"], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert proc.returncode != 0 and "name absolute host folders" in proc.stderr, proc.stderr
    assert not (shared / "other.bundle").exists() and not list(shared.glob("other.bundle.layout.*"))


def _run_oci_sbatch(tmp_path: Path, script: str, bundle: Path, **env) -> tuple[subprocess.CompletedProcess,
                                                                               list[list[str]]]:
    """Run the rendered script with srun and scontrol stubbed; return each srun call's argv."""
    stubs = _stubs(tmp_path / "job-stubs")
    args = tmp_path / "srun-args"
    run_env = {"PATH": f"{stubs}:{os.environ['PATH']}", "SRUN_ARGS": str(args), "SLURM_JOB_NODELIST": "node-[a-b]",
               "SLURM_JOB_NAME": "ftimage-sft", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42", "SLURM_NODEID": "0",
               "SLURM_PROCID": "0", "BUNDLE": str(bundle), "OUT": str(tmp_path / "shared" / "run"),
               "CONFIG": str(tmp_path / "shared" / "finetune.yaml"), "HOME": str(tmp_path), **env}
    args.unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=run_env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    return proc, _srun_calls(args)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None, reason="needs bash, python3")
def test_slurm_oci_example_runs_the_bundle_with_a_c10d_rendezvous(run_cli, pushed_out, tmp_path):
    script, shared, made = _oci_bundle(tmp_path, run_cli, pushed_out)
    assert made["proc"].returncode == 0, made["proc"].stderr
    bundle = shared / "smoke.bundle"
    assert "--signal=TERM@" in script and "bash -c" not in script and "sh -c" not in script
    assert "\n#SBATCH --no-requeue\n" in script

    proc, (verify, finetune) = _run_oci_sbatch(tmp_path, script, bundle)
    assert proc.returncode == 0, proc.stderr
    # every node's verify in a step of its own first (no --kill-on-bad-exit: the passing nodes exit 0)
    assert f"--container={bundle}" in verify and "--kill-on-bad-exit=1" not in verify
    assert verify[-3:] == [GATE, "--", "/bin/true"]
    assert f"--container={bundle}" in finetune and "--kill-on-bad-exit=1" in finetune
    assert "--export=HOME,RDZV_ENDPOINT,RDZV_ID" in finetune        # nothing else of the submitting shell
    command = finetune[finetune.index("--export=HOME,RDZV_ENDPOINT,RDZV_ID") + 1:]
    assert command == ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint", "finetune", "--config",
                       str(shared / "finetune.yaml"), f"output.dir={shared / 'run'}"]
    # Slurm 22.05 puts no task variables in the container: the batch step's would be node 0 on every node
    assert (tmp_path / "srun-args.ids").read_text().split() == ["unset", "unset"]

    proc, (verify, trainer) = _run_oci_sbatch(tmp_path, script, bundle, TRAIN_SCRIPT=str(shared / "train.py"),
                                              FTIMAGE_ALLOW_FALLBACK="1", CONTAINER_ENV="WANDB_MODE",
                                              NPROC_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr
    assert verify[-5:] == [GATE, "--model", "/shared/models/Qwen3.5-27B", "--", "/bin/true"]
    assert "--export=HOME,RDZV_ENDPOINT,RDZV_ID,FTIMAGE_ALLOW_FALLBACK,WANDB_MODE" in trainer
    command = trainer[trainer.index("--export=HOME,RDZV_ENDPOINT,RDZV_ID,FTIMAGE_ALLOW_FALLBACK,WANDB_MODE") + 1:]
    assert command[:4] == [GATE, "--model", "/shared/models/Qwen3.5-27B", "--"]
    assert command[4] == "/opt/ftimage/venv/bin/torchrun" and command[-1] == str(shared / "train.py")
    assert "--rdzv-endpoint=node-a:29400" in command and "--rdzv-id=42" in command and "--nproc-per-node=4" in command


@pytest.mark.parametrize("change, words", [
    ({"OUT": "/elsewhere/run"}, "/elsewhere/run is not under a folder the bundle binds"),
    ({"TRAIN_SCRIPT": "/home/me/train.py"}, "/home/me/train.py is not under a folder the bundle binds"),
    ({"BUNDLE": "/no/such/bundle"}, "is not the bundle of"),
])
def test_slurm_oci_example_refuses_what_the_container_cannot_see(run_cli, pushed_out, tmp_path, change, words):
    script, shared, made = _oci_bundle(tmp_path, run_cli, pushed_out)
    assert made["proc"].returncode == 0, made["proc"].stderr
    proc, srun = _run_oci_sbatch(tmp_path, script, shared / "smoke.bundle", **change)
    assert proc.returncode == 2 and words in proc.stderr and "fix: " in proc.stderr, proc.stderr
    assert srun == []


def test_render_without_a_push_record_says_push_first(run_cli, tmp_path, smoke_tag):
    out = _write_report(tmp_path / "out", smoke_tag, None)
    code, stdout, err = _render(run_cli, out, "k8s")
    assert code == 1 and stdout == ""
    assert "has no push record" in err and "fix: --push REGISTRY/REPO first" in err, err


def test_render_without_a_build_report_says_build_and_push(run_cli, tmp_path):
    code, _, err = _render(run_cli, tmp_path / "empty", "slurm")
    assert code == 1 and "no build report" in err and "--push REGISTRY/REPO" in err, err


def test_render_for_a_stale_push_is_refused(run_cli, tmp_path):
    out = _write_report(tmp_path / "out", "smoke:000000000000", _pushed())
    code, _, err = _render(run_cli, out, "k8s")
    assert code == 1 and "now builds" in err and f"--push {REPOSITORY}" in err, err


@pytest.mark.parametrize("changes, field", [
    ({"digest": DIGEST + "\nrm -rf /", "reference": f"{REPOSITORY}@{DIGEST}\nrm -rf /"}, "pushed.digest"),
    ({"digest": "sha256:" + "AB" * 32}, "pushed.digest"),
    ({"repository": "registry.example.com/team/$(id)"}, "pushed.repository"),
    ({"repository": "registry.example.com/team/x\"; y"}, "pushed.repository"),
    ({"reference": f"evil.example.com/x@{DIGEST}"}, "pushed.reference"),
    ({"tag": "registry.example.com:5000/team/smoke:$(id)"}, "pushed.tag"),
    ({"digest": 7}, "pushed.digest"),
])
def test_hostile_push_record_is_refused(run_cli, tmp_path, smoke_tag, changes, field):
    from build.publish.deploy_examples import TEMPLATES

    out = _write_report(tmp_path / "out", smoke_tag, _pushed(**changes))
    for kind in TEMPLATES:
        code, stdout, err = _render(run_cli, out, kind)
        assert code == 2 and stdout == "", err
        assert err.startswith("error: the push record has") and f": {field}: " in err and "fix: " in err, err
