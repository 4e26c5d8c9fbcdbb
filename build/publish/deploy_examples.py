"""`--deploy-example KIND`: render (print) an example of deploy/ for the image this build pushed,
pinned by the digest build-report.json recorded: the Kubeflow Trainer v2 ClusterTrainingRuntime
(k8s-runtime) and TrainJobs on it (k8s-trainjob: our finetune; k8s-trainjob-trl: a TRL script),
the legacy Training Operator PyTorchJob (k8s) or the Slurm scripts (slurm: pyxis/enroot; slurm-oci:
Slurm's own OCI containers, `srun --container`). It deploys nothing:
`python -m build IMAGE_DIR --deploy-example KIND` prints the rendered example.

The report is a file on disk, so every value read from it is checked against the same grammars
the push used (digest, repository) before it reaches a YAML document or a bash script; the
templates only ever see values that cannot carry quotes, `$(`, spaces or newlines.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from build.build_report import REPORT_NAME, PushRecord
from build.errors import BuildFailure
from build.publish.reference import DIGEST, reference_problems
from build.resolve import BuildPlan
from build.spec import REPO_ROOT
from contracts.finetune_config import build_config, set_dotted
from contracts.schema import InvalidInput, Problem

DEPLOY_DIR = REPO_ROOT / "deploy"
TEMPLATES = {"k8s-runtime": "kubernetes/clustertrainingruntime.yaml.j2",
             "k8s-trainjob": "kubernetes/trainjob.yaml.j2",
             "k8s-trainjob-trl": "kubernetes/trainjob.yaml.j2",
             "k8s": "kubernetes/pytorchjob.yaml.j2",          # legacy: Kubeflow deprecated kubeflow.org/v1
             "slurm": "slurm/finetune.sbatch.j2",
             "slurm-oci": "slurm/finetune-oci.sbatch.j2"}
DNS_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?"   # short enough for "<job>-worker-<n>" pod names
# A TrainJob's name: an RFC 1035 label (the Trainer's rule), at most 47 characters so that its
# pods' host names, <name>-node-0-<index>, stay within 63.
TRAINJOB_NAME = r"[a-z](?:[-a-z0-9]{0,45}[a-z0-9])?"
QUEUE_PLACEHOLDER = "user-queue"   # the Kueue LocalQueue the TrainJobs name: the user edits it


@dataclass(frozen=True)
class TrainJobKind:
    """What one TrainJob example runs: ours (finetune) or a TRL script."""
    trainer: str          # finetune | trl
    name_suffix: str      # after the runtime's name
    configmap: str        # what /config holds
    num_nodes: int


TRAINJOBS = {"k8s-trainjob": TrainJobKind("finetune", "", "ftimage-finetune", 3),
             "k8s-trainjob-trl": TrainJobKind("trl", "-trl", "ftimage-trl", 2)}
RECORD_FIELDS = ("repository", "tag", "digest", "reference")


class PushRecordErrors(InvalidInput):
    """A push record whose values do not pass the grammars (exit code 2): it was edited by hand
    or by something else, and will not be rendered into a script."""
    title = "the push record"


@dataclass(frozen=True)
class ExampleValues:
    """Everything a deploy template sees, each value already checked."""
    image: str            # REGISTRY/REPO@sha256:..., as Kubernetes and Docker write it
    enroot_image: str     # REGISTRY#REPO@sha256:..., as enroot/pyxis write it (registry before '#')
    image_name: str       # images/<name>
    job_name: str         # a DNS label for the PyTorchJob and its pods
    runtime_name: str     # the ClusterTrainingRuntime's name (the same label)
    queue_name: str       # the Kueue LocalQueue label value of the TrainJobs (a DNS label)
    trl_locked: bool      # whether the image's python.requirements hold trl
    uid: int              # the image's fixed non-root user
    gid: int
    stop_grace_seconds: int   # launch.stop_grace_seconds of the image's finetune defaults


def render_example(plan: BuildPlan, out_dir: Path, kind: str) -> str:
    """The `kind` example (a key of TEMPLATES) for the image pushed from out_dir's build."""
    if kind not in TEMPLATES:
        raise BuildFailure(f"no deploy example {kind!r}", f"use one of: {', '.join(TEMPLATES)}")
    values = dict(vars(example_values(plan, read_push_record(Path(out_dir), plan))))
    if kind in TRAINJOBS:
        values |= trainjob_values(values["runtime_name"], TRAINJOBS[kind])
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(DEPLOY_DIR), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    return env.get_template(TEMPLATES[kind]).render(**values)


def trainjob_values(runtime_name: str, job: TrainJobKind) -> dict[str, Any]:
    name = runtime_name + job.name_suffix
    if not re.fullmatch(TRAINJOB_NAME, name):   # the job name grammar makes this unreachable; kept as a guard
        raise BuildFailure(f"cannot derive a TrainJob name from {runtime_name!r}", "rename the image")
    return {"trainjob_name": name, "trainer": job.trainer, "configmap": job.configmap, "num_nodes": job.num_nodes}


def example_values(plan: BuildPlan, record: PushRecord) -> ExampleValues:
    registry, _, path = record.repository.partition("/")
    job = "ftimage-" + re.sub(r"[^a-z0-9-]+", "-", plan.spec.name)[:30].strip("-")
    if not re.fullmatch(DNS_LABEL, job):  # the image name grammar makes this unreachable; kept as a guard
        raise BuildFailure(f"cannot derive a Kubernetes job name from {plan.spec.name!r}", "rename the image")
    if not re.fullmatch(DNS_LABEL, QUEUE_PLACEHOLDER):   # a constant: guards an edit of it
        raise BuildFailure(f"the queue placeholder {QUEUE_PLACEHOLDER!r} is not a DNS label", "fix QUEUE_PLACEHOLDER")
    return ExampleValues(image=record.reference, enroot_image=f"{registry}#{path}@{record.digest}",
                         image_name=plan.spec.name, job_name=job, runtime_name=job, queue_name=QUEUE_PLACEHOLDER,
                         trl_locked=locks_trl(plan), uid=plan.spec.runtime.uid, gid=plan.spec.gid,
                         stop_grace_seconds=stop_grace_seconds(plan))


def locks_trl(plan: BuildPlan) -> bool:
    """Whether the image's python.requirements name trl (the image has no pip to add it later)."""
    names = set()
    for line in plan.spec.python.requirements:
        try:
            names.add(canonicalize_name(Requirement(line).name))
        except InvalidRequirement:
            continue   # the spec loader refuses these; nothing to name here
    return "trl" in names


def stop_grace_seconds(plan: BuildPlan) -> int:
    """The image's launch.stop_grace_seconds (validated with its finetune defaults at build time)."""
    layer: dict = {}
    for key, value in (plan.spec.finetune_defaults or {}).items():
        if isinstance(value, dict):
            layer[key] = dict(value)
        else:
            set_dotted(layer, key, value)
    return build_config([layer], require_paths=False).launch.stop_grace_seconds


def read_push_record(out_dir: Path, plan: BuildPlan) -> PushRecord:
    """The `pushed` record of out_dir's build report, checked, for the image `plan` builds now."""
    path = out_dir / REPORT_NAME
    name = plan.spec.name
    push_fix = f"--push REGISTRY/REPO first: python -m build images/{name} --push REGISTRY/REPO"
    if not path.is_file():
        raise BuildFailure(f"no build report at {path}: images/{name} was not built into {out_dir}",
                           f"{push_fix} (or pass the --out the build used)")
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BuildFailure(f"{path} is not a readable build report: {exc}", push_fix) from None
    if not isinstance(report, dict):
        raise BuildFailure(f"{path} is not a build report (a JSON object)", push_fix)
    pushed = report.get("pushed")
    if not pushed:
        raise BuildFailure(f"{path} has no push record: {str(report.get('tag', name))[:80]!r} was built but "
                           "never pushed, so there is no digest to deploy", push_fix)
    record = _checked_record(pushed, str(path))
    built = report.get("tag")
    if built != plan.tag:
        raise BuildFailure(f"the push record in {path} is for {str(built)[:80]!r}, but images/{name} now builds "
                           f"{plan.tag}: the pushed image is not the one this spec describes",
                           f"build and push the current plan: python -m build images/{name} --push "
                           f"{record.repository}")
    return record


def _checked_record(pushed: Any, file: str) -> PushRecord:
    if not isinstance(pushed, dict):
        raise PushRecordErrors([Problem(file, "pushed", "is not an object", "push again; the build writes it")])
    problems: list[Problem] = []
    fix = "push again (the build writes this record; do not edit it)"
    for key in RECORD_FIELDS:
        if not isinstance(pushed.get(key), str):
            problems.append(Problem(file, f"pushed.{key}", "is missing or not a string", fix))
    if problems:
        raise PushRecordErrors(problems)
    repository, digest = pushed["repository"], pushed["digest"]
    problems += reference_problems(repository, file=file, field="pushed.repository")
    if not re.fullmatch(DIGEST, digest):
        problems.append(Problem(file, "pushed.digest", f"{digest[:90]!r} is not a sha256:<64 lowercase hex> digest",
                                fix))
    if problems:   # the reference and tag below are built from these two: checking them adds only noise
        raise PushRecordErrors(problems)
    if pushed["reference"] != f"{repository}@{digest}":
        problems.append(Problem(file, "pushed.reference", f"{pushed['reference'][:120]!r} is not "
                                "REPOSITORY@DIGEST of this record", fix))
    tag_pattern = re.escape(repository) + r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
    if not re.fullmatch(tag_pattern, pushed["tag"]):
        problems.append(Problem(file, "pushed.tag", f"{pushed['tag'][:120]!r} is not REPOSITORY:TAG of this record",
                                fix))
    if problems:
        raise PushRecordErrors(problems)
    return PushRecord(**{key: pushed[key] for key in RECORD_FIELDS})
