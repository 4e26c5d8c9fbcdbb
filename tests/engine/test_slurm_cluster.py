"""Engine tier: the smoke image on a real Slurm cluster through Slurm's own OCI container support.

A controller and two slurmd nodes on this machine (tests/fixtures/slurm_cluster.py; Debian's Slurm
22.05), runc as oci.conf's runtime. The image reaches the nodes as Slurm needs it: the rendered
`--deploy-example slurm-oci` script's own `bundle` mode copies it (skopeo) from the OCI layout
the build wrote, by the manifest digest a push records, and unpacks it (umoci) into a rootless
bundle on the cluster's shared filesystem, as the unprivileged user who submits.
Every job is that rendered script, `sbatch`ed as that user; only paths and the test's resources
(no GPUs, one CPU, a time limit) come from outside it. Two nodes, one rank each.

The smoke image has no fused kernels, so verify fails on every node: the jobs that train pass
FTIMAGE_ALLOW_FALLBACK=1, and the one that must not train does not.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from entrypoint.checkpoint.dcp import is_complete, list_checkpoints, read_state, step_of
from tests.conftest import run_build_cli
from tests.fixtures.chat import write_fixture
from tests.fixtures.slurm_cluster import SlurmCluster, leftovers, make_root

pytestmark = pytest.mark.engine

REPOSITORY = "127.0.0.1:5000/ftimage/smoke"   # the push record's: the bundle comes from the build's layout
JOB_TIMEOUT = 180                              # seconds: each job takes well under half of it
# The rendered script asks for SIGTERM 600 s before the time limit, and Slurm sends it on its first
# pass (every 30 s) within 630 s of the limit: a job that must not be signalled asks for 30 minutes.
UNSIGNALLED = "--time=30"


def chown_tree(path: Path, uid: int, gid: int) -> None:
    for item in [path, *path.rglob("*")]:
        os.chown(item, uid, gid)


@pytest.fixture(scope="session")
def cluster():
    root = make_root()
    running = SlurmCluster(root)
    running.start()
    yield running
    running.stop()
    deadline = time.monotonic() + 20
    while (left := leftovers(running)) and time.monotonic() < deadline:
        time.sleep(0.5)
    shutil.rmtree(root, ignore_errors=True)
    assert not left, f"the cluster left behind: {left}"


@pytest.fixture(scope="session")
def oci(cluster, smoke_build):
    """The rendered slurm-oci script and the bundle its `bundle` mode made, under SHARED_DIRS.

    The image comes from the OCI layout the build wrote (what --push sends), with the manifest
    digest a push records: the script copies it from there (SOURCE) instead of a registry."""
    user, shared = cluster.user, cluster.shared
    home = shared / "home"
    home.mkdir()
    os.chown(shared, user.pw_uid, user.pw_gid)
    os.chown(home, user.pw_uid, user.pw_gid)
    layout = cluster.root / "layout"            # readable by the user (pytest's folders are not)
    shutil.copytree(smoke_build["out"] / "oci", layout, copy_function=link_or_copy)
    digest, tag = smoke_build["report"]["manifest_digest"], smoke_build["tag"]
    report = cluster.root / "report"
    report.mkdir()
    (report / "build-report.json").write_text(json.dumps({"image": "smoke", "tag": tag, "pushed": {
        "repository": REPOSITORY, "tag": f"{REPOSITORY}:{tag.rpartition(':')[2]}", "digest": digest,
        "reference": f"{REPOSITORY}@{digest}"}}))
    rendered = run_build_cli("images/smoke", "--deploy-example", "slurm-oci", "--out", str(report))
    assert rendered.returncode == 0, rendered.stderr
    script = shared / "finetune-oci.sbatch"
    script.write_text(rendered.stdout)
    script.chmod(0o644)
    bundle = shared / "smoke.bundle"
    started = time.monotonic()
    made = cluster.run(["bash", str(script), "bundle"], as_user=True, cwd=home, timeout=900, env=cluster.user_env(
        home, BUNDLE=str(bundle), SHARED_DIRS=str(shared), SOURCE=f"oci:{layout}:{tag}"))
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    shutil.rmtree(layout)
    print(f"bundle made in {time.monotonic() - started:.0f} s")
    return SimpleNamespace(script=script, bundle=bundle, shared=shared, home=home, digest=digest)


def link_or_copy(source: str, dest: str) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


@pytest.fixture(scope="session")
def tiny(oci, cluster):
    """The tiny model, its tokenizer and chat data under SHARED_DIRS, read by every job."""
    fx = write_fixture(oci.shared / "tiny", n_rows=64, config_overrides={"launch.nproc_per_node": 1})
    chown_tree(fx.root, cluster.user.pw_uid, cluster.user.pw_gid)
    return fx


def job_folder(cluster, oci, tiny, name: str, **overrides) -> tuple[Path, Path]:
    """(config, out) of one job: the tiny fixture's config with `overrides`, and an empty OUT."""
    folder = oci.shared / name
    folder.mkdir()
    config = yaml.safe_load(tiny.config.read_text())
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    chown_tree(folder, cluster.user.pw_uid, cluster.user.pw_gid)
    return folder / "config.yaml", folder / "out"


def submit(cluster, oci, name: str, *options: str, **env: str) -> int:
    """sbatch the rendered script as the test user: paths and resources from outside, nothing else."""
    job_env = cluster.user_env(oci.home, BUNDLE=str(oci.bundle), OMP_NUM_THREADS="1", CONTAINER_ENV="OMP_NUM_THREADS",
                               **env)
    return cluster.sbatch(oci.script, "--gpus-per-node=0", "--cpus-per-task=1", f"--output={oci.home}/{name}-%j.log",
                          *options, env=job_env, cwd=oci.home)


def log_of(oci, name: str, job_id: int) -> str:
    path = oci.home / f"{name}-{job_id}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def excerpt(log: str) -> str:
    """The start and the end of a job's log, for an assertion's message."""
    lines = [line for line in log.splitlines() if not line.startswith(("ftimage-guard", "[transformers]"))
             and " | " not in line and not re.match(r"\[finetune\] step \d+/", line)]
    return "\n".join(lines if len(lines) <= 100 else lines[:40] + ["..."] + lines[-60:])


def steps_done(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=0)


def wait_for_step(cluster, job_id: int, out: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(out) < step:
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} is {state} before step {step}"
        assert time.monotonic() < deadline, f"job {job_id} did not reach step {step} within {timeout:.0f} s"
        time.sleep(0.5)


def clean_nodes(cluster, timeout: float = 30) -> dict[str, list]:
    """What jobs left on the nodes (processes beside slurmd, the runtime's containers, the spooled
    bundles), once it has had `timeout` seconds to go."""
    deadline = time.monotonic() + timeout
    while True:
        left = {node.name: cluster.node_processes(node) for node in cluster.nodes}
        listed = cluster.run(["runc", "--root", str(cluster.runc_state / cluster.user.pw_name), "list", "-q"],
                             as_user=True)
        left["containers"] = listed.stdout.split()
        left["spool"] = [p.name for p in (cluster.root / "spool").glob("*/oci-job*")]
        left["user processes"] = [p.name for p in Path("/proc").glob("[0-9]*")
                                  if _uid_of(p) == cluster.user.pw_uid]
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.5)


def _uid_of(proc: Path) -> int | None:
    try:
        return proc.stat().st_uid
    except OSError:
        return None


def ran_on_both_nodes(cluster, job_id: int, step: int) -> bool:
    """Whether step `step` of the job (0: the script's verify step, 1: training) had a task on each node."""
    return all(f"[{job_id}.{step}] starting 1 tasks" in (cluster.log / f"slurmd-{node.name}.log").read_text()
               for node in cluster.nodes)


def completed_job(cluster, oci, name: str, out, config) -> tuple[str, str]:
    """Submit the finetune job `name` and wait for it: it must complete; (its id, its log)."""
    job_id = submit(cluster, oci, name, UNSIGNALLED, OUT=str(out), CONFIG=str(config), FTIMAGE_ALLOW_FALLBACK="1")
    job = cluster.wait(job_id, JOB_TIMEOUT)
    log = log_of(oci, name, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), excerpt(log)
    return job_id, log


# ---- (a) finetune on two nodes ---------------------------------------------------------------------
def test_two_node_finetune_through_slurm_oci(cluster, oci, tiny):
    """finetune in the bundle on both nodes, as the submitting user: the two node agents meet in a
    c10d rendezvous on ftn1 across the nodes' network namespaces, FSDP2 over both ranks."""
    config, out = job_folder(cluster, oci, tiny, "finetune", **{"train.max_steps": 4, "checkpoint.every": 2})
    started = time.monotonic()
    job_id, log = completed_job(cluster, oci, "finetune", out, config)
    print(f"two-node finetune: {time.monotonic() - started:.0f} s")
    report = json.loads((out / "run_report.json").read_text())
    assert report["status"] == "completed" and report["world_size"] == 2 and report["final_step"] == 4
    topology = report["topology"]
    assert (topology["nnodes"], topology["nproc_per_node"], topology["rdzv"]) == (2, 1, "c10d")
    assert topology["rdzv_endpoint"] == "ftn1:29400" and topology["rdzv_id"] == str(job_id)
    assert report["allow_fallback"] is True and report["verify"]["passed"] is False
    assert ran_on_both_nodes(cluster, job_id, 0) and ran_on_both_nodes(cluster, job_id, 1)
    assert (out / "final" / "model.safetensors").is_file() and "Traceback" not in log
    # rootless: the container's root is the submitting user, so is every file it wrote
    assert {p.stat().st_uid for p in out.rglob("*")} == {cluster.user.pw_uid}
    assert not clean_nodes(cluster)


# ---- (b) a user's trainer behind the gate ------------------------------------------------------------
TRAINER = """
import json, os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
seen = {{"rank": dist.get_rank(), "world": dist.get_world_size(), "host": socket.gethostname(),
        "sum": total.item(), "uid": os.getuid(), "allow_fallback": os.environ.get("FTIMAGE_ALLOW_FALLBACK"),
        "slurm": {{k: v for k, v in os.environ.items() if k.startswith("SLURM")}}}}
with open(os.path.join({out!r}, "rank%d.json" % dist.get_rank()), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
"""


def test_two_node_user_trainer_runs_behind_the_gate(cluster, oci, tiny):
    folder = oci.shared / "trainer"
    out = folder / "out"
    out.mkdir(parents=True)
    (folder / "train.py").write_text(TRAINER.format(out=str(out)))
    chown_tree(folder, cluster.user.pw_uid, cluster.user.pw_gid)
    started = time.monotonic()
    job_id = submit(cluster, oci, "trainer", UNSIGNALLED, OUT=str(out), TRAIN_SCRIPT=str(folder / "train.py"),
                    MODEL=str(tiny.model_dir), NPROC_PER_NODE="1", CONFIG=str(tiny.config), FTIMAGE_ALLOW_FALLBACK="1")
    job = cluster.wait(job_id, JOB_TIMEOUT)
    log = log_of(oci, "trainer", job_id)
    print(f"two-node gated trainer: {time.monotonic() - started:.0f} s")
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), excerpt(log)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert {r["host"] for r in ranks} == {"ftn1", "ftn2"}        # one rank on each node, by its own host name
    assert [r["sum"] for r in ranks] == [3.0, 3.0] and {r["world"] for r in ranks} == {2}
    assert {r["uid"] for r in ranks} == {0} and {r["allow_fallback"] for r in ranks} == {"1"}
    # Slurm 22.05 writes the container's environment before a task's own variables exist, and the
    # script unsets the batch step's (0 everywhere): the job's variables only
    seen = {*ranks[0]["slurm"], *ranks[1]["slurm"]}
    assert {r["slurm"]["SLURM_JOB_ID"] for r in ranks} == {str(job_id)} and "SLURM_NNODES" in seen
    assert not {"SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURMD_NODENAME"} & seen
    # the gate on each node, in the script's verify step, then in front of the trainer
    assert log.count("override given (FTIMAGE_ALLOW_FALLBACK=1), running /bin/true") == 2, excerpt(log)
    assert log.count("override given (FTIMAGE_ALLOW_FALLBACK=1), running /opt/ftimage/venv/bin/torchrun") == 2
    assert not clean_nodes(cluster)


# ---- (c) the time limit's SIGTERM, then the same job again ---------------------------------------------
def stop_by_time_limit(cluster, oci, name: str, out: Path, config: Path, after_step: int) -> tuple[dict, str, float]:
    """Submit with a time limit far away, and once training runs bring it to 10 minutes: within
    the rendered --signal=TERM@600, so Slurm's next time-limit pass (every 30 s) sends SIGTERM."""
    job_id = submit(cluster, oci, name, UNSIGNALLED, OUT=str(out), CONFIG=str(config), FTIMAGE_ALLOW_FALLBACK="1")
    started = time.monotonic()
    wait_for_step(cluster, job_id, out, after_step)
    moved = cluster.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"])
    assert moved.returncode == 0, moved.stderr
    job = cluster.wait(job_id, JOB_TIMEOUT)
    return job, log_of(oci, name, job_id), time.monotonic() - started


@pytest.fixture(scope="module")
def signalled(cluster, oci, tiny):
    """A long run stopped by the time limit's SIGTERM: (config, out, log, job record)."""
    config, out = job_folder(cluster, oci, tiny, "resume", **{"train.max_steps": 2000, "checkpoint.every": 2000,
                                                              "checkpoint.export": False})
    job, log, took = stop_by_time_limit(cluster, oci, "resume", out, config, after_step=2)
    print(f"signalled run: {took:.0f} s")
    return SimpleNamespace(config=config, out=out, log=log, job=job)


STOPPED = re.compile(r"stopped by SIGTERM after a checkpoint at step (\d+)")
# entrypoint/checkpoint/safe_load.py admits no builtins.getattr, and the image's Python (Debian 12's
# 3.11.2) pickles an Enum member as getattr(cls, name): every DCP .metadata written in the image
# holds one (TensorProperties.memory_format), so resume=auto skips every checkpoint as unsafe
SAFE_LOAD_REFUSES_ENUM = "it asks to load builtins.getattr, which is not checkpoint metadata"


def test_time_limit_signal_checkpoints_and_exits_143(cluster, signalled):
    log, out = signalled.log, signalled.out
    assert (signalled.job["JobState"], signalled.job["ExitCode"]) == ("FAILED", "143:0"), excerpt(log)
    stopped = STOPPED.search(log)
    assert stopped, excerpt(log)
    step = int(stopped.group(1))
    assert step >= 2 and (out / "checkpoints" / f"step-{step:08d}").is_dir()
    assert log.count("stop requested (SIGTERM)") == 2, excerpt(log)   # both nodes' launchers took it
    report = json.loads((out / "run_report.json").read_text())
    assert report["interrupted"] and report["final_step"] == step and report["world_size"] == 2
    assert not clean_nodes(cluster)


def test_the_same_job_resubmitted_resumes_from_that_checkpoint(cluster, oci, signalled):
    first = int(STOPPED.search(signalled.log).group(1))
    out = signalled.out
    job_id = submit(cluster, oci, "resume", UNSIGNALLED, OUT=str(out), CONFIG=str(signalled.config),
                    FTIMAGE_ALLOW_FALLBACK="1")
    started = time.monotonic()
    while steps_done(out) < first + 2:          # job 1's records stop at `first`: these are job 2's
        log = log_of(oci, "resume", job_id)
        assert SAFE_LOAD_REFUSES_ENUM not in log, excerpt(log)   # the image's own checkpoints resume
        assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), excerpt(log)
        assert time.monotonic() - started < JOB_TIMEOUT, excerpt(log)
        time.sleep(0.5)
    moved = cluster.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"])
    assert moved.returncode == 0, moved.stderr
    job = cluster.wait(job_id, JOB_TIMEOUT)
    log = log_of(oci, "resume", job_id)
    print(f"resubmitted run: {time.monotonic() - started:.0f} s")
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "143:0"), excerpt(log)
    assert f"resumed from {out / 'checkpoints' / f'step-{first:08d}'} at step {first}" in log, excerpt(log)
    second = int(STOPPED.search(log).group(1))
    assert second > first + 1
    report = json.loads((out / "run_report.json").read_text())
    assert report["resumed_from"].endswith(f"step-{first:08d}") and report["final_step"] == second
    assert not clean_nodes(cluster)


# ---- (d) scancel -----------------------------------------------------------------------------------------
def test_scancel_leaves_no_process_on_either_node(cluster, oci, tiny):
    config, out = job_folder(cluster, oci, tiny, "cancel", **{"train.max_steps": 2000, "checkpoint.every": 2000})
    job_id = submit(cluster, oci, "cancel", UNSIGNALLED, OUT=str(out), CONFIG=str(config), FTIMAGE_ALLOW_FALLBACK="1")
    wait_for_step(cluster, job_id, out, 1)
    running = {node.name: [cmd for _, cmd in cluster.node_processes(node)] for node in cluster.nodes}
    for node, commands in running.items():
        assert any("entrypoint.train" in c for c in commands), (node, commands)   # a rank on each node
        assert any(c.startswith("runc ") for c in commands), (node, commands)
    env = cluster.user_env(oci.home)
    cancelled = cluster.run(["scancel", str(job_id)], as_user=True, env=env, cwd=oci.home)
    assert cancelled.returncode == 0, cancelled.stderr
    started = time.monotonic()
    job = cluster.wait(job_id, 120)
    assert job["JobState"] == "CANCELLED", job
    left = clean_nodes(cluster, timeout=60)
    print(f"scancel to clean nodes: {time.monotonic() - started:.0f} s")
    assert not left, left


# ---- (e) one node's verify fails -------------------------------------------------------------------------
def test_a_node_whose_verify_fails_stops_the_job_with_exit_3_before_any_step(cluster, oci, tiny):
    """ftn1's copy of the bundle allows the fallback (its config.json, bound over the shared one in
    that node's mount namespace only), ftn2's does not: ftn1 passes its gate, ftn2's verify fails.
    The whole job must end with exit 3 before any node trains: not 143, which would read as
    "resubmit to resume" (what srun reports when the failure comes inside the training step, from
    the nodes it stops while they wait in the rendezvous)."""
    config, out = job_folder(cluster, oci, tiny, "refused", **{"train.max_steps": 4})
    spec = json.loads((oci.bundle / "config.json").read_text())
    spec["process"]["env"].append("FTIMAGE_ALLOW_FALLBACK=1")
    passing = cluster.root / "ftn1-config.json"
    passing.write_text(json.dumps(spec))
    node = cluster.nodes[0]
    bound = cluster.in_node(node, ["mount", "--bind", str(passing), str(oci.bundle / "config.json")])
    assert bound.returncode == 0, bound.stderr
    try:
        started = time.monotonic()
        job_id = submit(cluster, oci, "refused", UNSIGNALLED, OUT=str(out), CONFIG=str(config))
        job = cluster.wait(job_id, JOB_TIMEOUT)
        print(f"refused job: {time.monotonic() - started:.0f} s")
    finally:
        cluster.in_node(node, ["umount", str(oci.bundle / "config.json")])
    log = log_of(oci, "refused", job_id)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "3:0"), excerpt(log)
    assert "override given (FTIMAGE_ALLOW_FALLBACK=1), running /bin/true" in log, excerpt(log)  # ftn1 passed
    assert "verify did not pass (worst: FAIL); not starting /bin/true" in log, excerpt(log)       # ftn2 did not
    assert "[finetune] running verify" not in log and steps_done(out) == 0   # the training step never started
    assert ran_on_both_nodes(cluster, job_id, 0)
    assert not any(f"[{job_id}.1]" in (cluster.log / f"slurmd-{n.name}.log").read_text() for n in cluster.nodes)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not clean_nodes(cluster)


# ---- (f) a node dies in the middle of the training step, then the same job again ---------------------------
NODE_FAILED_STEPS = 30      # the resubmission runs to the end: COMPLETED is its own proof of the resume


def wait_for_checkpoint(cluster, job_id: int, out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list_checkpoints(out / "checkpoints"):
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} is {state} before a checkpoint"
        assert time.monotonic() < deadline, f"job {job_id} wrote no checkpoint within {timeout:.0f} s"
        time.sleep(0.2)


def test_a_node_dying_mid_step_fails_the_job_naming_it_and_the_job_again_resumes(cluster, oci, tiny):
    """ftn2 dies as a machine does once a checkpoint is on the shared filesystem: its link goes
    dark, then slurmd, slurmstepd, runc and the rank on it get SIGKILL. ftn1's rank, waiting for
    ftn2's in a collective, hears nothing. slurmctld finds ftn2 not responding, sets it DOWN and
    the job NODE_FAIL, and ends ftn1's part. The user must see which node died; the checkpoint
    must stay valid; the same job, once ftn2 is back, must resume from it."""
    config, out = job_folder(cluster, oci, tiny, "nodefail", **{"train.max_steps": NODE_FAILED_STEPS,
                                                                "checkpoint.every": 5, "checkpoint.export": False})
    failed_id = job_id = submit(cluster, oci, "nodefail", UNSIGNALLED, OUT=str(out), CONFIG=str(config),
                                FTIMAGE_ALLOW_FALLBACK="1")
    dead = cluster.nodes[1]         # not the batch host: the script and its srun live on to report it
    started = time.monotonic()
    try:
        wait_for_checkpoint(cluster, job_id, out)
        killed = cluster.kill_node(dead)
        # no rank can complete another checkpoint now: each needs ftn2's part
        saved = list_checkpoints(out / "checkpoints")
        job = cluster.wait(job_id, JOB_TIMEOUT)
        down = cluster.run(["scontrol", "-o", "show", "node", dead.name]).stdout
        print(f"node failure to the job's end: {time.monotonic() - started:.0f} s")
    finally:
        cluster.restart_node(dead)
    log = log_of(oci, "nodefail", job_id)
    assert any("entrypoint.train" in command for _, command in killed), killed    # a rank died with the node
    # the script's --no-requeue: the job ends (a site's JobRequeue=1 would put it back in the queue)
    assert (job["JobState"], job["Requeue"], job["Restarts"]) == ("NODE_FAIL", "0", "0"), (job, excerpt(log))
    assert "State=DOWN" in down and "Reason=Not responding" in down, down
    assert f"srun: error: Node failure on {dead.name}" in log, excerpt(log)
    assert not STOPPED.search(log) and steps_done(out) < NODE_FAILED_STEPS   # no checkpoint claimed at the end

    # the checkpoint written before the node died: complete for both ranks, and valid as resume reads it
    newest = saved[-1]
    assert list_checkpoints(out / "checkpoints")[-1] == newest and is_complete(newest, world_size=2)
    state = read_state(newest)
    assert state.step == step_of(newest) >= 5

    _, log = completed_job(cluster, oci, "nodefail", out, config)
    print(f"node failure and the job again: {time.monotonic() - started:.0f} s")
    assert f"resumed from {newest} at step {state.step}" in log, excerpt(log)
    report = json.loads((out / "run_report.json").read_text())
    assert report["resumed_from"].endswith(newest.name) and report["final_step"] == NODE_FAILED_STEPS
    assert report["world_size"] == 2 and ran_on_both_nodes(cluster, job_id, 1)
    # all that is left: the dead node's spooled copy of the killed step's config.json (slurmd keeps
    # SlurmdSpoolDir across a restart; a site cleans SlurmdSpoolDir/oci-job* at boot)
    left = clean_nodes(cluster, timeout=10)
    assert set(left) <= {"spool"} and all(n.startswith(f"oci-job{failed_id:05d}-") for n in left.get("spool", [])), \
        left
