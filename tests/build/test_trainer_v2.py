"""--deploy-example k8s-runtime | k8s-trainjob | k8s-trainjob-trl: the Kubeflow Trainer v2 examples,
rendered from a build report and checked field by field against our summary of the Trainer
v2.2.0 API (tests/fixtures/trainer_v2_api.yaml), by value against what the Trainer's
controllers do with them (its Torch and JobSet plugins, v2.2.0), and against the legacy
PyTorchJob's hardening, which they copy."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from build.resolve import load_plan
from build.spec import MANIFEST_PATH, REPO_ROOT
from tests.fixtures import cel_subset, k8s_schema

pytestmark = pytest.mark.unit

SMOKE = str(REPO_ROOT / "images" / "smoke")
GATE = "/opt/ftimage/bin/ftimage-gate"
DIGEST = "sha256:" + "ab" * 32
REPOSITORY = "registry.example.com:5000/team/smoke"
IMAGE = f"{REPOSITORY}@{DIGEST}"
PINNED = re.compile(r"[a-z0-9.:/_-]+@sha256:[0-9a-f]{64}")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")                 # RFC 1123, as Kueue's queue names
DOMAIN_PATH = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9/._~%!$&'()*+,;=:@-]+")   # a runtimePatch manager
TORCH_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
TRAINJOBS = ("k8s-trainjob", "k8s-trainjob-trl")


def _pushed_out(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tag = load_plan(Path(SMOKE), MANIFEST_PATH).tag
    pushed = {"repository": REPOSITORY, "tag": f"{REPOSITORY}:0123456789ab", "digest": DIGEST, "reference": IMAGE}
    (out / "build-report.json").write_text(json.dumps({"image": "smoke", "tag": tag, "pushed": pushed}))
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    """Every Kubernetes example rendered once (KIND: its documents, each through yaml.safe_load;
    KIND:text: the text)."""
    from build.publish.deploy_examples import render_example

    out = _pushed_out(tmp_path_factory.mktemp("out"))
    plan = load_plan(Path(SMOKE), MANIFEST_PATH)
    docs: dict = {}
    for kind in ("k8s-runtime", *TRAINJOBS, "k8s"):
        text = render_example(plan, out, kind)
        docs[kind] = [d for d in yaml.safe_load_all(text) if d is not None]
        docs[kind + ":text"] = text
    return docs


def test_the_cli_renders_each_trainer_v2_example(run_cli, tmp_path, rendered):
    from build.cli.build_command import DEPLOY_EXAMPLES
    from build.publish.deploy_examples import TEMPLATES

    assert DEPLOY_EXAMPLES == tuple(TEMPLATES)
    out = _pushed_out(tmp_path / "out")
    for kind in ("k8s-runtime", *TRAINJOBS):
        code, text, err = run_cli([SMOKE, "--deploy-example", kind, "--out", str(out)])
        assert code == 0 and text == rendered[kind + ":text"], err


def _schema_at(node: dict, *keys: str) -> dict:
    for key in keys:
        node = node["items"] if key == "[]" else node["fields"][key]
    return node


def _runtime(rendered) -> dict:
    return rendered["k8s-runtime"][0]


def _node_job(runtime: dict) -> dict:
    return runtime["spec"]["template"]["spec"]["replicatedJobs"][0]


def _node_pod(runtime: dict) -> dict:
    return _node_job(runtime)["template"]["spec"]["template"]["spec"]


# ---- the ClusterTrainingRuntime ----------------------------------------------------------

def test_runtime_documents_are_the_runtime_and_its_admission_policy(rendered):
    assert [(d["apiVersion"], d["kind"]) for d in rendered["k8s-runtime"]] == [
        ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding")]


def test_runtime_matches_the_trainer_v2_2_api(rendered):
    runtime = _runtime(rendered)
    assert k8s_schema.check(runtime) == []
    spec = runtime["spec"]
    # the Torch ML policy of v2.2: an empty object (numProcPerNode was removed) beside numNodes
    assert spec["mlPolicy"]["torch"] == {} and isinstance(spec["mlPolicy"]["numNodes"], int)
    assert set(spec) == {"mlPolicy", "template"} and "elasticPolicy" not in spec["mlPolicy"]
    # the Trainer finds the trainer job and container by these names and this label
    jobs = spec["template"]["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["node"]
    assert jobs[0]["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    containers = _node_pod(runtime)["containers"]
    assert [c["name"] for c in containers] == ["node"]
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"


def test_runtime_pins_the_digest_and_puts_every_pod_behind_the_gate(rendered):
    container = _node_pod(_runtime(rendered))["containers"][0]
    assert container["image"] == IMAGE and PINNED.fullmatch(container["image"])
    # Kubernetes `command:` bypasses the ENTRYPOINT: the gate is the command, the TrainJob's args its argv
    assert container["command"] == [GATE, "--"]
    assert container["args"][:5] == ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint", "finetune"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"FTIMAGE_REQUIRE_VERIFY": "1", "HOME": "/tmp"}
    assert not TORCH_RESERVED & set(env)     # the Trainer sets those; the launcher reads them as they are
    assert "sh -c" not in rendered["k8s-runtime:text"] and "/bin/sh" not in rendered["k8s-runtime:text"]


def test_runtime_copies_the_pytorchjob_hardening_exactly(rendered):
    legacy = rendered["k8s"][0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    pod = _node_pod(_runtime(rendered))
    assert pod["securityContext"] == legacy["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["terminationGracePeriodSeconds"] == legacy["terminationGracePeriodSeconds"]
    container, old = pod["containers"][0], legacy["containers"][0]
    assert container["securityContext"] == old["securityContext"] == {
        "runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}}
    assert container["resources"] == old["resources"]
    # what must be writable on a read-only root: the same volumes, mounted at the same places
    writable = {"/tmp", "/dev/shm"}
    assert [m for m in container["volumeMounts"] if m["mountPath"] in writable] == \
           [m for m in old["volumeMounts"] if m["mountPath"] in writable]
    names = {m["name"] for m in container["volumeMounts"]}
    assert pod["volumes"] == [v for v in legacy["volumes"] if v["name"] in names]
    assert {"name": "HOME", "value": "/tmp"} in container["env"] and {"name": "HOME", "value": "/tmp"} in old["env"]
    assert pod["restartPolicy"] == "Never" and _node_job(_runtime(rendered))["template"]["spec"]["backoffLimit"] == 0


# ---- the TrainJobs -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", TRAINJOBS)
def test_trainjob_matches_the_trainer_v2_2_api(rendered, kind):
    (job,) = rendered[kind]
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert k8s_schema.check(job) == []
    runtime = _runtime(rendered)
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": runtime["metadata"]["name"]}
    queue = job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    assert DNS_LABEL.fullmatch(queue) and queue == "user-queue"
    trainer = job["spec"]["trainer"]
    assert isinstance(trainer["numNodes"], int) and trainer["numNodes"] >= 2
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}}
    # the runtime's gate and pinned image stay: a TrainJob names neither (the policy refuses both)
    assert "command" not in trainer and "image" not in trainer
    assert not TORCH_RESERVED & {e["name"] for e in trainer.get("env", [])}   # the Torch plugin refuses these
    assert f"kubectl apply -f {job['metadata']['name']}.yaml" in rendered[kind + ":text"]


def test_the_trainjobs_run_finetune_and_a_trl_script(rendered):
    (ours,), (trl,) = rendered["k8s-trainjob"], rendered["k8s-trainjob-trl"]
    assert ours["spec"]["trainer"]["args"] == ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint", "finetune",
                                               "--config", "/config/finetune.yaml"]
    args = trl["spec"]["trainer"]["args"]
    assert args[:2] == ["/opt/ftimage/venv/bin/torchrun", "/config/train_trl.py"] and "--output_dir" in args
    assert not any(a.startswith(("--nnodes", "--node-rank", "--master", "--rdzv")) for a in args)
    assert ours["metadata"]["name"] != trl["metadata"]["name"]
    # images/smoke locks no trl: the example says so, and how to add it
    assert "lock has no trl" in rendered["k8s-trainjob-trl:text"]


def _patched_pod(runtime: dict, job: dict) -> dict:
    """The node pod after the TrainJob's runtimePatches, merged as the Trainer does (a strategic
    merge: containers and volumes by name, volumeMounts by mountPath)."""
    pod = copy.deepcopy(_node_pod(runtime))
    for patch in job["spec"]["runtimePatches"]:
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            assert rjob["name"] == "node"
            spec = rjob["template"]["spec"]["template"]["spec"]
            for c in spec.get("containers", []):
                (target,) = [t for t in pod["containers"] if t["name"] == c["name"]]
                assert "env" not in c      # the Trainer refuses env patches on the node container
                paths = {m["mountPath"] for m in target["volumeMounts"]}
                assert not paths & {m["mountPath"] for m in c["volumeMounts"]}
                target["volumeMounts"] += c["volumeMounts"]
            assert not {v["name"] for v in pod["volumes"]} & {v["name"] for v in spec.get("volumes", [])}
            pod["volumes"] += spec.get("volumes", [])
    return pod


@pytest.mark.parametrize("kind", TRAINJOBS)
def test_trainjob_volumes_reach_the_runtime_pod(rendered, kind):
    (job,) = rendered[kind]
    for patch in job["spec"]["runtimePatches"]:
        assert DOMAIN_PATH.fullmatch(patch["manager"]), patch["manager"]
    pod = _patched_pod(_runtime(rendered), job)
    pod_schema = _schema_at(k8s_schema.api()["kinds"]["ClusterTrainingRuntime"]["schema"], "spec", "template",
                            "spec", "replicatedJobs", "[]", "template", "spec", "template", "spec")
    assert k8s_schema.check(pod, pod_schema) == []   # the merged pod is still a PodSpec the runtime may hold
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert set(mounts) == {"/config", "/models", "/data", "/out", "/tmp", "/dev/shm"}
    assert all(mounts[p].get("readOnly") is True for p in ("/config", "/models", "/data"))
    assert not mounts["/out"].get("readOnly")
    assert {m["name"] for m in mounts.values()} == {v["name"] for v in pod["volumes"]}


# ---- the topology the Trainer sets reaches our launcher and torchrun -------------------------

def _torch_plugin_env(job: dict, rank: int) -> dict[str, str]:
    """The PET_* variables the Trainer's Torch plugin (v2.2.0) sets on the node container: the node
    count, `auto` processes per node when the node has GPUs, the Job completion index as node rank,
    the first node's host name in the JobSet's headless service and port 29500."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    gpus = trainer["resourcesPerNode"]["limits"].get("nvidia.com/gpu", 0)
    return {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": "auto" if gpus else "1",
            "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}


def test_finetune_reads_the_trainer_topology(rendered, monkeypatch):
    from contracts.finetune_config import FinetuneConfig
    from entrypoint.launcher import torchrun

    (job,) = rendered["k8s-trainjob"]
    monkeypatch.setattr(torchrun, "device_count", lambda: 8)
    runtime_env = {e["name"]: e["value"] for e in _node_pod(_runtime(rendered))["containers"][0]["env"]}
    topo = torchrun.resolve_topology(FinetuneConfig(), {**runtime_env, **_torch_plugin_env(job, 2)})
    name = job["metadata"]["name"]
    assert (topo.nnodes, topo.node_rank, topo.nproc_per_node, topo.rdzv) == (job["spec"]["trainer"]["numNodes"], 2,
                                                                               8, "static")
    assert (topo.master_addr, topo.master_port) == (f"{name}-node-0-0.{name}", 29500)
    # every host name the JobSet gives its pods is a DNS label
    assert DNS_LABEL.fullmatch(f"{name}-node-0-{job['spec']['trainer']['numNodes'] - 1}")


def test_torchrun_reads_the_trainer_topology_for_the_trl_script(rendered, monkeypatch):
    from torch.distributed.run import get_args_parser

    (job,) = rendered["k8s-trainjob-trl"]
    for key, value in _torch_plugin_env(job, 1).items():
        monkeypatch.setenv(key, value)
    args = get_args_parser().parse_args(job["spec"]["trainer"]["args"][1:])
    name = job["metadata"]["name"]
    assert (args.nnodes, args.nproc_per_node, int(args.node_rank)) == (str(job["spec"]["trainer"]["numNodes"]),
                                                                       "auto", 1)
    assert (args.master_addr, int(args.master_port), args.rdzv_backend) == (f"{name}-node-0-0.{name}", 29500,
                                                                            "static")
    assert args.training_script == "/config/train_trl.py"


# ---- the admission policy: what makes the gate the only way in -------------------------------

def _admits(rendered, job: dict) -> bool | None:
    """True/False: what the runtime's policy answers for job; None: the policy does not apply."""
    policy, binding = rendered["k8s-runtime"][1:]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": ["trainer.kubeflow.org"], "apiVersions": ["v1alpha1"],
                    "operations": ["CREATE", "UPDATE"], "resources": ["trainjobs"]}
    variables = {"object": job}
    for condition in policy["spec"]["matchConditions"]:
        matched = cel_subset.evaluate(condition["expression"], variables)
        assert not cel_subset.is_error(matched)
        if matched is not True:
            return None
    results = [cel_subset.evaluate(v["expression"], variables) for v in policy["spec"]["validations"]]
    assert not any(cel_subset.is_error(r) for r in results)   # an error would refuse the TrainJob too
    return all(results)


def test_the_policy_admits_our_trainjobs_and_refuses_a_replaced_gate_or_image(rendered):
    (ours,), (trl,) = rendered["k8s-trainjob"], rendered["k8s-trainjob-trl"]
    assert _admits(rendered, ours) is True and _admits(rendered, trl) is True
    bare = copy.deepcopy(ours)
    del bare["spec"]["trainer"]           # the runtime's defaults: finetune, behind the gate
    assert _admits(rendered, bare) is True
    for field, value in (("command", ["/opt/ftimage/venv/bin/torchrun", "train.py"]), ("command", []),
                         ("image", "registry.example.com/other@" + DIGEST)):
        job = copy.deepcopy(trl)
        job["spec"]["trainer"][field] = value
        assert _admits(rendered, job) is False, field
    other = copy.deepcopy(trl)
    other["spec"]["runtimeRef"]["name"] = "torch-distributed"
    other["spec"]["trainer"]["command"] = ["torchrun", "train.py"]
    assert _admits(rendered, other) is None    # another runtime is not this policy's business
    messages = " ".join(v["message"] for v in rendered["k8s-runtime"][1]["spec"]["validations"])
    assert GATE in messages and "spec.trainer.args" in messages


def test_the_cel_subset_refuses_what_it_does_not_know():
    with pytest.raises(cel_subset.CelError):
        cel_subset.evaluate("object.spec.trainer.args.size() > 0", {"object": {}})
    assert cel_subset.is_error(cel_subset.evaluate("has(object.spec.trainer.command)", {"object": {"spec": {}}}))
    assert cel_subset.evaluate("!has(object.spec.trainer) || has(object.spec.trainer.command)",
                               {"object": {"spec": {}}}) is True


# ---- the checker itself ------------------------------------------------------------------------

def test_the_checker_refuses_an_unknown_field_a_wrong_type_and_a_missing_required_one(rendered):
    runtime, (job,) = _runtime(rendered), rendered["k8s-trainjob"]

    def problems(obj, edit) -> list[str]:
        obj = copy.deepcopy(obj)
        edit(obj)
        return k8s_schema.check(obj)

    def pod(obj):
        return _node_pod(obj)

    assert problems(runtime, lambda r: r["spec"]["mlPolicy"]["torch"].update(numProcPerNode=8)) == [
        "spec.mlPolicy.torch.numProcPerNode: unknown field"]
    assert problems(runtime, lambda r: r["spec"]["mlPolicy"].update(elasticPolicy={})) == [
        "spec.mlPolicy.elasticPolicy: unknown field"]
    assert problems(runtime, lambda r: r["spec"]["mlPolicy"].update(numNodes="3")) == [
        "spec.mlPolicy.numNodes: '3' is not an integer"]
    assert problems(runtime, lambda r: r["spec"]["mlPolicy"].update(torch=[])) == [
        "spec.mlPolicy.torch: is list, not an object"]
    assert problems(runtime, lambda r: pod(r)["securityContext"].update(runAsNonRoot="true")) == [
        "spec.template.spec.replicatedJobs[0].template.spec.template.spec.securityContext.runAsNonRoot: "
        "'true' is not a boolean"]
    assert problems(runtime, lambda r: pod(r)["containers"][0].pop("name")) == [
        "spec.template.spec.replicatedJobs[0].template.spec.template.spec.containers[0].name: "
        "required field is missing"]
    assert problems(runtime, lambda r: pod(r)["containers"].append(copy.deepcopy(pod(r)["containers"][0]))) == [
        "spec.template.spec.replicatedJobs[0].template.spec.template.spec.containers: name 'node' appears twice"]
    assert problems(runtime, lambda r: r["metadata"].pop("name")) == ["metadata.name: required field is missing"]
    assert problems(job, lambda j: j["spec"].update(podTemplateOverrides=[])) == [
        "spec.podTemplateOverrides: unknown field"]
    assert problems(job, lambda j: j["spec"].pop("runtimeRef")) == ["spec.runtimeRef: required field is missing"]
    assert problems(job, lambda j: j["spec"]["trainer"]["resourcesPerNode"]["limits"].update(cpu="lots")) == [
        "spec.trainer.resourcesPerNode.limits['cpu']: 'lots' is not a quantity"]
    assert problems(job, lambda j: j["metadata"].update(name="9-starts-with-a-digit")) == [
        "metadata.name: '9-starts-with-a-digit' does not match ^[a-z]([-a-z0-9]*[a-z0-9])?$"]
    assert problems(job, lambda j: j["spec"]["trainer"].update(numNodes=2 ** 31)) == [
        "spec.trainer.numNodes: 2147483648 is outside -2147483648..2147483647"]


# ---- the summary against the CRDs it was read from (where a clone of the repository is at hand) --

TRAINER_GIT = os.environ.get("KUBEFLOW_TRAINER_GIT", "")


def _crd_schema(kind: dict) -> dict:
    text = subprocess.run(["git", "-C", TRAINER_GIT, "show", f"{k8s_schema.api()['upstream']['tag']}:{kind['crd']}"],
                          capture_output=True, text=True, check=True).stdout
    crd = yaml.safe_load(text)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == k8s_schema.api()["upstream"]["version"]]
    assert crd["spec"]["scope"] == kind["scope"]
    assert f"{crd['spec']['group']}/{version['name']}" == kind["apiVersion"]
    return version["schema"]["openAPIV3Schema"]


def _agree(ours: dict, theirs: dict, path: str) -> list[str]:
    if ours.get("source") == "ObjectMeta":
        return []
    kind, problems = ours["type"], []
    expected = {"object": "object", "map": "object", "list": "array", "string": "string", "integer": "integer",
                "boolean": "boolean"}
    if kind == "quantity":
        if not theirs.get("x-kubernetes-int-or-string") or theirs.get("pattern") != ours["pattern"]:
            problems.append(f"{path}: not a quantity upstream")
        return problems
    if theirs.get("type") != expected[kind]:
        return [f"{path}: {kind} here, {theirs.get('type')} upstream"]
    for key in ("format", "enum", "minLength", "maxLength", "maxItems", "pattern"):
        if key in ours and key in theirs and ours[key] != theirs[key]:
            problems.append(f"{path}: {key} {ours[key]!r} here, {theirs[key]!r} upstream")
    if kind == "object":
        if sorted(ours.get("required", [])) != sorted(theirs.get("required", [])):
            problems.append(f"{path}: required {ours.get('required', [])} here, {theirs.get('required', [])} upstream")
        upstream_fields = theirs.get("properties", {})
        for name, node in ours["fields"].items():
            if name not in upstream_fields:
                problems.append(f"{path}.{name}: not in the CRD")
            else:
                problems += _agree(node, upstream_fields[name], f"{path}.{name}")
    elif kind == "map":
        problems += _agree(ours["values"], theirs.get("additionalProperties", {}), f"{path}[*]")
    elif kind == "list":
        if "key" in ours and theirs.get("x-kubernetes-list-map-keys") != [ours["key"]]:
            problems.append(f"{path}: list-map key {ours['key']} here, {theirs.get('x-kubernetes-list-map-keys')} "
                            "upstream")
        problems += _agree(ours["items"], theirs.get("items", {}), f"{path}[]")
    return problems


@pytest.mark.skipif(not (TRAINER_GIT and Path(TRAINER_GIT).exists()),
                    reason="set KUBEFLOW_TRAINER_GIT to a clone of kubeflow/trainer (with tag v2.2.0)")
@pytest.mark.parametrize("kind", ["ClusterTrainingRuntime", "TrainJob"])
def test_the_api_summary_agrees_with_the_upstream_crds(kind):
    summary = k8s_schema.api()["kinds"][kind]
    assert _agree(summary["schema"], _crd_schema(summary), kind) == []
