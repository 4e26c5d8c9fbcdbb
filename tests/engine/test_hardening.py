"""Engine tier: the runtime image runs only its own code and resists a hostile mount, has
no setuid programs or bundled pip wheels, and verify works on a read-only root."""
from __future__ import annotations

import json

import pytest

from tests.fixtures.containers import run_in as _run

pytestmark = pytest.mark.engine

HIJACK = "HIJACKED-BY-WORKSPACE"


@pytest.fixture
def hostile_workspace(tmp_path):
    """What a careless or hostile job mounts as its working directory: packages named like
    the image's own, and a yaml.py, each announcing itself and exiting 0."""
    ws = tmp_path / "workspace"
    for pkg in ("verify", "entrypoint", "contracts", "families"):
        (ws / pkg).mkdir(parents=True)
        body = f"print('{HIJACK} {pkg}'); raise SystemExit(0)\n"
        (ws / pkg / "__init__.py").write_text(body)
        (ws / pkg / "__main__.py").write_text(body)
    (ws / "yaml.py").write_text(f"print('{HIJACK} yaml'); raise SystemExit(0)\n")
    (ws / "torch.py").write_text(f"print('{HIJACK} torch'); raise SystemExit(0)\n")
    ws.chmod(0o755)
    for p in ws.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return ws


@pytest.mark.parametrize("command, expected_exit", [
    (["verify", "--device", "cpu", "--checks", "environment,dispatch"], 2),   # fails closed on a CPU image
    (["gate", "--", "sh", "-c", "echo user-command-$((6*7))"], 3),
    (["/opt/ftimage/bin/ftimage-gate", "--", "sh", "-c", "echo user-command-$((6*7))"], 3),
    (["finetune", "--config", "/workspace/missing.yaml"], 2),
    (["info"], 0),
])
def test_image_code_runs_whatever_the_working_directory_holds(smoke_image, hostile_workspace, command,
                                                               expected_exit):
    code, out = _run(smoke_image, command, working_dir="/workspace",
                     volumes={str(hostile_workspace): {"bind": "/workspace", "mode": "ro"}},
                     environment={"PYTHONPATH": "/workspace"})
    assert HIJACK not in out, out[-2000:]
    assert code == expected_exit, out[-3000:]
    assert "Traceback" not in out and "user-command-42" not in out


def test_require_verify_gates_a_plain_command_in_the_image(smoke_image):
    code, out = _run(smoke_image, ["sh", "-c", "echo user-command-$((6*7))"],
                     environment={"FTIMAGE_REQUIRE_VERIFY": "1"})
    assert code == 3 and "user-command-42" not in out and "RESULT: FAIL" in out, out[-3000:]
    code, out = _run(smoke_image, ["sh", "-c", "echo user-command-$((6*7))"],
                     environment={"FTIMAGE_REQUIRE_VERIFY": "1", "FTIMAGE_ALLOW_FALLBACK": "1"})
    assert code == 0 and "user-command-42" in out and "override given (FTIMAGE_ALLOW_FALLBACK=1)" in out


def test_no_setuid_programs_and_no_bundled_pip_wheels(smoke_image):
    code, out = _run(smoke_image, ["sh", "-c", "find / -xdev -perm /6000 -type f 2>/dev/null; "
                                               "ls /usr/share/python-wheels 2>/dev/null; echo END"], user="0")
    assert code == 0 and out.strip() == "END", out


def test_verify_on_a_read_only_root_with_no_tmpfs(smoke_image):
    # arbitrary uid (OpenShift style), every capability dropped, nothing writable at all
    code, out = _run(smoke_image, ["verify", "--device", "cpu", "--checks", "environment,dispatch,isolation"],
                     read_only=True, user="12345:0", cap_drop=["ALL"], security_opt=["no-new-privileges"])
    assert code == 2, out[-3000:]                       # the CPU image fails closed, as designed
    assert "RESULT: FAIL" in out and "Traceback" not in out
    assert "Read-only file system" not in out and "isolation.gdn" in out


@pytest.mark.parametrize("user, status, says", [
    (None, "PASS", "runs as uid 10001"),
    ("0:0", "WARN", "runs as real root: uid 0"),
])
def test_verify_names_the_user_it_runs_as_and_warns_for_real_root(smoke_image, user, status, says):
    # Slurm's OCI path and pyxis run no ENTRYPOINT: the row comes from verify itself, which the
    # entrypoint's finetune and the gate both run
    options = {"user": user} if user else {}
    code, out = _run(smoke_image, ["verify", "--device", "cpu", "--checks", "environment", "--json"], **options)
    rows = {r["check"]: r for r in json.loads(out[out.index("{"):])["results"]}
    assert rows["environment.user"]["status"] == status and says in rows["environment.user"]["detail"], rows


def test_the_image_ships_the_app_but_not_its_tests(smoke_image):
    code, out = _run(smoke_image, ["sh", "-c", "ls /opt/ftimage/app; python -I -c 'import tests' 2>&1 | tail -1"])
    assert code == 0, out
    assert {"verify", "entrypoint", "contracts", "families"} <= set(out.split())
    assert "tests" not in out.split() and "No module named 'tests'" in out


def test_the_rendered_context_holds_no_test_module(smoke_build):
    context = smoke_build["out"] / "context"
    assert (context / "Dockerfile").is_file()
    names = [p.relative_to(context).as_posix() for p in context.rglob("*")]
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n or n.rsplit("/", 1)[-1].startswith("test_")
                or n.endswith("conftest.py")], names
