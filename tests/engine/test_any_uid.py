"""Engine tier: the image as clusters really run it, under dockerd and under podman.

Clusters do not run an image as it says (entrypoint/launcher/job_env.py): OpenShift gives a random
uid with gid 0 and no passwd entry; Kubernetes, docker and podman make the root read-only with only
/tmp writable; enroot and Apptainer keep a HOME the uid cannot write, or none; pyxis and Apptainer
run no ENTRYPOINT, only the command given in full. Under each, `verify`, a command behind the gate,
`finetune` (a checkpoint and the export), `inspect-data` and TRL behind the gate must work, the
gated command must get writable caches, a usable HOME and a user name, and nothing may be written
outside the output folder and those caches.

What it costs decides the shape: one container per runtime runs every condition at once, and in
it a driver script runs the five commands in turn (the `matrix` fixture); each condition alone
runs only `verify`, the cheap command; and a root with nothing writable at all must be a clear
error naming the folder and the fix, never a traceback. The image is images/smoke-trl: the smoke
image plus TRL (the same app, entrypoint and hardening), so one image serves every command and
podman copies one image out of dockerd.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO_ROOT
from tests.fixtures.chat import write_fixture
from tests.fixtures.runtimes import RUNTIMES, Options, require, run

pytestmark = pytest.mark.engine

PYTHON_ENTRYPOINT = ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint"]   # the image's ENTRYPOINT
UID = 4242                                 # any uid: the image's passwd knows only 10001 (trainer)

# The five commands, each as pyxis and Apptainer run it: no ENTRYPOINT, the command in full. Each
# step's output is framed for the test (`### STEP name` ... `### RC name code`); `left` lists what
# the job left in the writable folders outside the output mount.
DRIVER = r"""#!/bin/sh
PY=/opt/ftimage/venv/bin/python
GATE=/opt/ftimage/bin/ftimage-gate
TRL='{"trainer": "trl", "kernels": "none", "attention": "sdpa", "batches": "padded", "steps": 1,
      "tokenizer": "/job/fx/model"}'
command() {
    case $1 in
    verify) $PY -I -m entrypoint verify --device cpu --checks environment,dispatch,isolation --json ;;
    gate) FTIMAGE_ALLOW_FALLBACK=1 $PY -I -m entrypoint gate -- python /job/train.py ;;
    finetune) $PY -I -m entrypoint finetune --config /job/fx/config.yaml --allow-fallback output.dir=/out/finetune ;;
    inspect-data) $PY -I -m entrypoint inspect-data --config /job/fx/config.yaml --rows 1 --json ;;
    trl) FTIMAGE_ALLOW_FALLBACK=1 $GATE -- python /job/tests/guard/scenarios.py "$TRL" /out/trl ;;
    left) find /tmp /dev/shm -mindepth 1 -maxdepth 2 ;;
    esac
}
for step in "$@"; do
    echo "### STEP $step"
    command "$step" 2>&1
    echo "### RC $step $?"
done
"""

# A job's train.py behind the gate: who it is, and a file written into every cache the libraries
# resolve, as Triton, inductor, the hub and datasets would. Triton and inductor load the shared
# objects they compile from their caches, so one is loaded from each: a cache on a noexec mount
# (docker's and podman's `--tmpfs` default) would fail there on a GPU.
TRAIN_PY = """
import ctypes, getpass, glob, json, os, pathlib, shutil, sysconfig
import datasets.config, huggingface_hub.constants
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

folders = {"HOME": os.path.expanduser("~"), "TRITON_CACHE_DIR": os.environ["TRITON_CACHE_DIR"],
           "inductor": inductor_cache_dir(), "HF_HOME": huggingface_hub.constants.HF_HOME,
           "hub": huggingface_hub.constants.HF_HUB_CACHE, "datasets": datasets.config.HF_DATASETS_CACHE,
           "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]}
folders = {name: str(folder) for name, folder in folders.items()}
shared_object = sorted(glob.glob(sysconfig.get_config_var("DESTSHARED") + "/_json*.so"))[0]
for name, folder in folders.items():
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "probe").write_text("written")
    if name in ("TRITON_CACHE_DIR", "inductor"):
        ctypes.CDLL(shutil.copy(shared_object, path / "launcher.so"))
print("SEEN " + json.dumps({"user": getpass.getuser(), "uid": os.getuid(), "folders": folders,
                            "HF_DATASETS_OFFLINE": os.environ.get("HF_DATASETS_OFFLINE")}))
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """What a team mounts read-only at /job: the finetune fixture (a one-step run, checkpoint and
    export), train.py, TRL's script (tests/guard/scenarios.py) with the fixtures it imports, and
    the driver."""
    root = tmp_path_factory.mktemp("any-uid-job")
    write_fixture(root / "fx", n_rows=32, mount_root="/job/fx",
                  config_overrides={"train.max_steps": 1, "checkpoint.every": 1, "launch.nproc_per_node": 1})
    for sub in ("guard", "fixtures"):
        shutil.copytree(REPO_ROOT / "tests" / sub, root / "tests" / sub,
                        ignore=shutil.ignore_patterns("__pycache__", "test_*.py"))
    (root / "train.py").write_text(TRAIN_PY)
    (root / "driver.sh").write_text(DRIVER)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


@pytest.fixture(scope="module")
def podman_image(trl_image):
    """The TRL image copied out of dockerd into podman's own storage (as `podman pull` from a
    registry would store it; test_registry.py pulls the pushed smoke image that way)."""
    require("podman")
    done = subprocess.run(["podman", "pull", "-q", f"docker-daemon:{trl_image}"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    image_id = done.stdout.split()[-1]
    yield image_id
    subprocess.run(["podman", "rmi", "-f", image_id], capture_output=True, timeout=300)


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request, trl_image) -> tuple[str, str]:
    """(runtime, the image as that runtime names it)."""
    return request.param, request.getfixturevalue("podman_image") if request.param == "podman" else trl_image


def steps(output: str) -> dict[str, tuple[int, str]]:
    """The driver's framed output: step -> (exit code, its output)."""
    return {m[1]: (int(m[3]), m[2]) for m in re.finditer(r"^### STEP (\S+)\n(.*?)^### RC \1 (\d+)$", output,
                                                         re.S | re.M)}


def json_of(text: str) -> dict:
    return json.loads(text[text.index("{"):text.rindex("}") + 1])


# ---- every condition at once, the five commands -------------------------------------------------------
@pytest.fixture(scope="module")
def matrix(runtime, job, tmp_path_factory):
    """One container: uid 4242 with gid 0 and no passwd entry, a read-only root, /tmp the only
    writable folder besides the output mount, the image's HOME (/home/trainer, not this uid's), no
    ENTRYPOINT."""
    name, image = runtime
    out = tmp_path_factory.mktemp(f"any-uid-out-{name}")
    out.chmod(0o777)                          # the job's volume, writable by whatever uid runs it
    every = Options(user=f"{UID}:0", read_only=True, tmpfs=("/tmp",), entrypoint="",
                    volumes=((str(job), "/job", "ro"), (str(out), "/out", "rw")))
    ran = run(name, image, ["/bin/sh", "/job/driver.sh", "verify", "gate", "finetune", "inspect-data", "trl", "left"],
              every, timeout=1800)
    found = steps(ran.stdout)
    assert list(found) == ["verify", "gate", "finetune", "inspect-data", "trl", "left"], ran.out[-4000:]
    return {"steps": found, "out": out, "ran": ran}


def step(matrix, name: str, expected: int = 0) -> str:
    code, text = matrix["steps"][name]
    assert code == expected, f"{name} exited {code}:\n{text[-4000:]}"
    assert "Traceback" not in text, text[-4000:]
    return text


def test_verify_under_every_condition(matrix):
    report = json_of(step(matrix, "verify", expected=2))    # the CPU image fails closed, as designed
    rows = {r["check"]: r for r in report["results"]}
    assert "environment.scratch" not in rows, rows.get("environment.scratch")
    assert f"runs as uid {UID}, gid 0" in rows["environment.user"]["detail"], rows["environment.user"]
    assert "isolation.gdn" in rows


def test_the_gated_command_gets_writable_caches_a_home_and_a_user(matrix):
    text = step(matrix, "gate")
    seen = json.loads(next(line for line in text.splitlines() if line.startswith("SEEN "))[5:])
    assert seen["uid"] == UID and seen["user"] == f"uid{UID}"            # getpass.getuser() answers
    for name, folder in seen["folders"].items():   # HOME and every cache in this uid's private scratch
        assert folder.startswith(f"/tmp/ftimage-{UID}/"), (name, folder)
    assert seen["HF_DATASETS_OFFLINE"] == "1" and "override given" in text


def test_finetune_writes_a_checkpoint_and_the_export(matrix):
    step(matrix, "finetune")
    out = matrix["out"] / "finetune"
    assert json.loads((out / "run_report.json").read_text())["allow_fallback"] is True
    assert len([p for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")]) == 1   # step 1
    assert (out / "final" / "model.safetensors").is_file()


def test_inspect_data(matrix):
    assert json_of(step(matrix, "inspect-data"))["summary"]["rows_read"] >= 1


def test_trl_behind_the_gate(matrix):
    text = step(matrix, "trl")
    assert "TRAINED" in text and "[gate]" in text and "override given" in text, text[-4000:]


# what the private scratch holds (verify/scratch.py, job_env.py): HOME, TMPDIR when /tmp is not
# writable, the caches, the corpus's datasets cache and torchrun's log folder
SCRATCH = {"home", "tmp", "triton", "inductor", "xdg", "huggingface", "matplotlib", "datasets", "torchelastic"}


def test_nothing_is_written_outside_the_output_folder_and_the_caches(matrix):
    """The root is read-only: what is writable is the output mount, /tmp and /dev/shm."""
    left = step(matrix, "left").split()
    private = f"/tmp/ftimage-{UID}"
    assert [p for p in left if p != private and not p.startswith(private + "/")] == [], left
    kept = {p.removeprefix(private + "/") for p in left if p.startswith(private + "/")}
    assert kept <= SCRATCH, kept
    assert sorted(p.name for p in matrix["out"].iterdir()) == ["finetune", "trl"]


# ---- each condition alone: verify ---------------------------------------------------------------------
VERIFY = ["verify", "--device", "cpu", "--checks", "environment", "--json"]
ALONE = {
    # OpenShift's restricted SCC: a uid from the project's range, gid 0, no passwd entry
    "openshift-uid": (Options(user="1000680000:0"), VERIFY),
    # a uid and gid the image does not know, so no folder is writable through gid 0 either
    "no-passwd-entry": (Options(user="4343:4343"), VERIFY),
    "read-only-root-only-tmp": (Options(read_only=True, tmpfs=("/tmp",)), VERIFY),
    # a uid passwd knows finds its home there; one it does not know has none at all (Path.home() raises)
    "home-unset": (Options(user="4343:4343", entrypoint="/usr/bin/env"), ["-u", "HOME", *PYTHON_ENTRYPOINT, *VERIFY]),
    "home-unwritable": (Options(env={"HOME": "/opt/ftimage"}), VERIFY),
    "no-entrypoint": (Options(entrypoint=""), [*PYTHON_ENTRYPOINT, *VERIFY]),
}


@pytest.mark.parametrize("condition", list(ALONE))
def test_verify_under_one_condition(runtime, condition):
    name, image = runtime
    options, command = ALONE[condition]
    ran = run(name, image, command, options)
    assert ran.code == 2, ran.out[-3000:]                    # the CPU image fails closed, as designed
    assert "Traceback" not in ran.out, ran.out[-3000:]
    rows = {r["check"]: r for r in json_of(ran.stdout)["results"]}
    assert "environment.scratch" not in rows and rows["environment.user"]["status"] == "PASS", rows
    uid = (options.user or "10001").split(":")[0]
    assert f"runs as uid {uid}," in rows["environment.user"]["detail"], rows["environment.user"]
    # what verify wrote on a writable root: its private scratch under /tmp, nothing else
    assert [c for c in ran.changes if c.split()[-1] != "/tmp" and not c.split()[-1].startswith("/tmp/")] == [], \
        ran.changes


# ---- nothing writable at all: a clear error ----------------------------------------------------------
def test_a_root_with_no_writable_folder_is_a_clear_error_naming_the_fix(runtime, job):
    """A read-only root, no tmpfs, and no /dev/shm (`--ipc none`): nothing this uid can write."""
    name, image = runtime
    nothing = Options(user=f"{UID}:0", read_only=True, ipc="none", entrypoint="",
                      volumes=((str(job), "/job", "ro"),))
    ran = run(name, image, ["/bin/sh", "/job/driver.sh", "gate", "finetune", "inspect-data", "verify"], nothing)
    found = steps(ran.stdout)
    assert list(found) == ["gate", "finetune", "inspect-data", "verify"], ran.out[-4000:]
    for command, (code, text) in found.items():
        assert code == 2, f"{command} exited {code}:\n{text[-3000:]}"
        assert "no writable temporary directory (tried /tmp, /var/tmp, /dev/shm)" in text, text[-3000:]
        assert "mount a tmpfs at /tmp" in text and "Traceback" not in text, text[-3000:]
