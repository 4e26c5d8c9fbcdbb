"""What every process of a job gets, our ranks and a command behind the gate alike: writable
caches, a usable HOME and TMPDIR, and a user name for a uid with no passwd entry (OpenShift's
random uid, enroot's and Apptainer's invoking uid on a read-only root)."""
from __future__ import annotations

import getpass
import os
import pwd
import stat
import subprocess
import sys

import pytest

from entrypoint.launcher import job_env as job_env_module
from entrypoint.launcher.job_env import CACHES, job_env
from entrypoint.launcher.verify_gate import GateOutcome

pytestmark = pytest.mark.unit


@pytest.fixture
def environ(gate_environ):
    return gate_environ


def test_unusable_home_and_caches_move_to_a_private_scratch(tmp_path):
    # root ignores mode bits, so "unusable" here is a path under a plain file: no uid can create it
    (tmp_path / "not-a-folder").write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"HOME": str(tmp_path / "not-a-folder"), "TMPDIR": str(tmp),
           "TRITON_CACHE_DIR": str(tmp_path / "not-a-folder" / ".triton" / "cache")}
    added = job_env(env)
    private = tmp / f"ftimage-{os.getuid()}"
    assert added["HOME"].startswith(str(private)) and added["TRITON_CACHE_DIR"].startswith(str(private))
    for name, _ in CACHES:
        assert os.path.isdir(added[name]) and os.access(added[name], os.W_OK), name
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    assert "TMPDIR" not in added          # it was writable: kept


def test_home_unset_or_missing_gets_one(tmp_path):
    for home in ("", "/nonexistent-home"):
        added = job_env({"HOME": home, "TMPDIR": str(tmp_path)})
        assert os.path.isdir(added["HOME"]) and added["HOME"].startswith(str(tmp_path))


def test_torchruns_log_folder_is_kept_in_the_private_scratch(tmp_path, monkeypatch):
    """Without --log-dir, torchrun leaves a new /tmp/torchelastic_* behind each run."""
    from torch.distributed.run import parse_args

    added = job_env({"HOME": "", "TMPDIR": str(tmp_path)})
    assert added["PET_LOG_DIR"] == str(tmp_path / f"ftimage-{os.getuid()}" / "torchelastic")
    assert os.path.isdir(added["PET_LOG_DIR"])
    monkeypatch.setenv("PET_LOG_DIR", added["PET_LOG_DIR"])
    assert parse_args(["train.py"]).log_dir == added["PET_LOG_DIR"]     # torchrun reads it as --log-dir
    assert "PET_LOG_DIR" not in job_env({"TMPDIR": str(tmp_path), "PET_LOG_DIR": "/logs/elastic"})


def test_a_uid_without_a_passwd_entry_gets_a_user_name_getuser_reads(tmp_path, monkeypatch):
    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(job_env_module.pwd, "getpwuid", unknown)
    added = job_env({"HOME": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert added["USER"] == added["LOGNAME"] == f"uid{os.getuid()}"
    # what getpass.getuser() does with it, in a process whose passwd lookup would fail the same way
    code = ("import getpass, pwd\n"
            "def unknown(uid): raise KeyError(uid)\n"
            "pwd.getpwuid = unknown\n"
            "print(getpass.getuser())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOGNAME", "USER", "LNAME", "USERNAME")}
    done = subprocess.run([sys.executable, "-c", code], env={**env, **added}, capture_output=True, text=True)
    assert done.stdout.strip() == f"uid{os.getuid()}", done.stderr
    bare = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bare.returncode != 0 and "KeyError" in bare.stderr       # what a command got before


def test_a_known_uid_or_a_set_user_is_left_alone(tmp_path):
    pwd.getpwuid(os.getuid())      # this machine knows the uid the tests run as
    assert "USER" not in job_env({"HOME": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert "USER" not in job_env({"HOME": str(tmp_path), "TMPDIR": str(tmp_path), "USER": "alice"})
    assert getpass.getuser()


def test_the_command_behind_the_gate_gets_the_job_environment(environ, monkeypatch, tmp_path):
    from entrypoint import cli

    (tmp_path / "not-a-folder").write_text("")      # a cache no uid can create (root ignores mode bits)
    environ.update({"HOME": "/nonexistent-home", "TMPDIR": str(tmp_path),
                    "TRITON_CACHE_DIR": str(tmp_path / "not-a-folder" / ".triton" / "cache")})
    for name in ("XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR"):
        environ.pop(name, None)
    seen = {}
    monkeypatch.setattr(cli, "exec_command", lambda argv: seen.update(os.environ) or 0)
    outcome = GateOutcome(passed=True, worst="PASS", table="")
    assert cli.gate(["--", "python", "train.py"], run_verify=lambda **kw: outcome) == 0
    private = str(tmp_path / f"ftimage-{os.getuid()}")
    for name in ("HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert seen[name].startswith(private) and os.access(seen[name], os.W_OK), name
    assert seen["HF_DATASETS_OFFLINE"] == "1"


def test_a_uid_that_can_write_nowhere_is_one_error_naming_the_folders(environ, monkeypatch, capsys):
    from entrypoint import cli
    from verify import scratch

    def nowhere(env):
        raise scratch.NoScratch(["/tmp", "/var/tmp"])

    monkeypatch.setattr(job_env_module, "private_scratch", nowhere)
    monkeypatch.setattr(cli, "exec_command", lambda argv: pytest.fail("ran without writable caches"))
    assert cli.gate(["--", "python", "train.py"], run_verify=lambda **kw: pytest.fail("verified")) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "/var/tmp" in err and "fix:" in err and "Traceback" not in err


def test_the_gate_says_which_families_the_node_proved(environ, monkeypatch, capsys, tmp_path):
    import dataclasses

    from entrypoint import cli
    from tests.fixtures.locks import environment_lock

    lock = tmp_path / "build.lock.json"
    lock.write_text(dataclasses.replace(environment_lock(), model_families=("qwen3_5_text", "falcon_h1")).to_json())
    environ.update({"FTIMAGE_LOCK": str(lock), "TMPDIR": str(tmp_path)})
    monkeypatch.setattr(cli, "exec_command", lambda argv: 0)
    every = GateOutcome(passed=True, worst="PASS", table="", report={"results": []})
    assert cli.gate(["--", "python", "train.py"], run_verify=lambda **kw: every) == 0
    assert "[gate] verify passed for model families qwen3_5_text, falcon_h1" in capsys.readouterr().err
    mounted = GateOutcome(passed=True, worst="PASS", table="", report={"results": [
        {"check": "model_family", "status": "PASS", "detail": "", "data": {"family": "falcon_h1"}}]})
    assert cli.gate(["--", "python", "train.py"], run_verify=lambda **kw: mounted) == 0
    assert "[gate] verify passed for model family falcon_h1" in capsys.readouterr().err
