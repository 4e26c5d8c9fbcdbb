"""Engine tier: deploy/child-image built on the smoke image, offline, keeps what the base
promises: the non-root user, the lock and its label, the entrypoint, and the gate in front
of a user's trainer."""
from __future__ import annotations

import hashlib
import re
import uuid

import docker
import pytest

from tests.conftest import REPO_ROOT
from tests.fixtures.containers import with_test_env

pytestmark = pytest.mark.engine

CHILD_CONTEXT = REPO_ROOT / "deploy" / "child-image"
LOCK = "/etc/ftimage/build.lock.json"
LOCK_LABEL = "io.ftimage.lock.sha256"
TRAIN_MARK = "team_trainer.py: torch"
# The child's ENV gates every pass-through command; inspecting the image should not cost a
# verify run per command, and the variable is a default a run may override.
UNGATED = {"FTIMAGE_REQUIRE_VERIFY": "0"}


@pytest.fixture(scope="module")
def client():
    return docker.from_env(timeout=900)


@pytest.fixture(scope="module")
def child_image(client, smoke_image):
    tag = f"ftimage-child-test:{uuid.uuid4().hex[:12]}"
    try:
        client.images.build(path=str(CHILD_CONTEXT), tag=tag, buildargs={"BASE": smoke_image},
                            network_mode="none", pull=False, rm=True, forcerm=True)
    except docker.errors.BuildError as exc:
        log = "".join(chunk.get("stream", "") or chunk.get("error", "") for chunk in exc.build_log)
        pytest.fail(f"child build failed: {exc}\n{log[-3000:]}")
    yield tag
    try:
        client.images.remove(tag, force=True)
    except docker.errors.ImageNotFound:
        pass


def run(client, image: str, command: list[str] | None = None, *, environment: dict[str, str] | None = None,
        stderr: bool = True) -> tuple[int, str]:
    container = client.containers.create(image, command, network_mode="none",
                                         environment=with_test_env(environment), detach=True)
    try:
        container.start()
        code = container.wait(timeout=900)["StatusCode"]
        return code, container.logs(stdout=True, stderr=stderr).decode(errors="replace")
    finally:
        container.remove(force=True)


def test_child_runs_as_the_base_non_root_user_with_its_entrypoint(client, smoke_image, child_image):
    code, out = run(client, child_image, ["id", "-u"], environment=UNGATED)
    assert code == 0 and out.strip() == "10001", out
    base, child = client.images.get(smoke_image).attrs["Config"], client.images.get(child_image).attrs["Config"]
    assert child["User"] == base["User"]
    assert child["Entrypoint"] == base["Entrypoint"] == ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint"]


def test_trainer_is_root_owned_and_not_writable_by_the_job(client, child_image):
    code, out = run(client, child_image,
                    ["sh", "-c", "stat -c %u:%g /opt/app/team_trainer.py; "
                                 "test -w /opt/app/team_trainer.py && echo writable || echo read-only"],
                    environment=UNGATED)
    assert code == 0 and out.split() == ["0:0", "read-only"], out


def test_child_carries_the_base_lock_and_its_label(client, smoke_image, child_image):
    code, lock_text = run(client, child_image, ["cat", LOCK], environment=UNGATED, stderr=False)
    assert code == 0, lock_text
    base_label = client.images.get(smoke_image).labels[LOCK_LABEL]
    assert hashlib.sha256(lock_text.encode()).hexdigest() == base_label
    assert client.images.get(child_image).labels.get(LOCK_LABEL) == base_label


def test_trainer_goes_through_the_gate_and_is_refused_on_a_failing_node(client, child_image):
    code, out = run(client, child_image, ["python", "/opt/app/team_trainer.py"])
    assert code == 3, out[-3000:]
    assert "RESULT: FAIL" in out and TRAIN_MARK not in out, out[-3000:]


def test_override_runs_the_trainer_on_the_record(client, child_image):
    code, out = run(client, child_image, ["python", "/opt/app/team_trainer.py"],
                    environment={"FTIMAGE_ALLOW_FALLBACK": "1"})
    assert code == 0, out[-3000:]
    assert "override given (FTIMAGE_ALLOW_FALLBACK=1)" in out
    assert f"{TRAIN_MARK} 2.13.0+cpu" in out and "uid 10001" in out, out[-3000:]


def test_default_command_is_the_gated_trainer(client, child_image):
    code, out = run(client, child_image)
    assert code == 3 and TRAIN_MARK not in out, out[-3000:]


def test_the_base_verify_still_runs_in_the_child(client, child_image):
    code, out = run(client, child_image, ["verify", "--device", "cpu", "--checks", "environment"])
    assert "RESULT:" in out and "Traceback" not in out, out[-3000:]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^([\w.]+)\s+\|\s+(\w+)\s+\|", out, re.M)}
    # Nothing was installed over the base, so what is there still matches the lock file by file.
    for check in ("lock", "environment.torch", "environment.transformers", "environment.packages"):
        assert rows.get(check) == "PASS", (check, out[-3000:])
    assert code == 2 and "RESULT: FAIL" in out, out[-3000:]   # a CPU image has no CUDA device, by design


def test_every_environment_row_of_the_child_image_passes(client, child_image):
    from tests.fixtures.verify_rows import environment_rows_that_do_not_pass, report_from_output

    _code, output = run(client, child_image, ["verify", "--json", "--checks", "environment"], environment=UNGATED)
    assert environment_rows_that_do_not_pass(report_from_output(output)) == []
