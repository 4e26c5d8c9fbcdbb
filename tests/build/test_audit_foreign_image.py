"""`python -m build audit IMAGE`: reference validation, the refusal logic from probe results, the
payload that travels (pure Python, read-only, behind the image's site-packages, removed after),
and the run itself against a fake engine."""
from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from build.audit import foreign_image as fi
from build.audit import verify_payload as vp
from build.engine import ContainerStartFailed, RunResult
from tests.fakes.engine import FakeEngine

pytestmark = pytest.mark.unit


# -- the reference --------------------------------------------------------------------------------

@pytest.mark.parametrize("ref", ["smoke", "smoke:42c72b4cab72", "ftimage-base/debian-bookworm:c7ba5f6cad1c",
                                 "registry.example.com:5000/team/img:v1.2", "localhost/a/b",
                                 "img@sha256:" + "a" * 64, "img:tag@sha256:" + "0" * 64, "sha256:" + "f" * 64,
                                 "5847676291bb"])
def test_docker_references_are_accepted(ref):
    assert fi.validate_reference(ref) == ref


@pytest.mark.parametrize("ref", ["", "Smoke", "-v", "--privileged", "img:tag:tag", "../../containers/x",
                                 "img tag", "img\nother", "img;rm -rf /", "img@sha256:abc", "img:" + "t" * 200,
                                 "a" * 600, "http://registry/img", "img/", "/img", "img@md5:" + "a" * 32,
                                 "img$(id)", "img:tag\x00"])
def test_hostile_references_are_refused_before_the_engine_sees_them(ref):
    with pytest.raises(fi.AuditRefused) as err:
        fi.validate_reference(ref)
    assert "not a Docker image reference" in str(err.value) and err.value.fix
    assert "\n" not in str(err.value) and "\x00" not in str(err.value)


# -- refusal from the probe -----------------------------------------------------------------------

def probe(version=(3, 11, 2), torch=True, transformers=True, yaml=True, executable="/usr/bin/python3"):
    return fi.Probe(executable, version, {"torch": {"found": torch, "version": "2.13.0" if torch else None},
                                          "transformers": {"found": transformers, "version": "5.18.0"},
                                          "yaml": {"found": yaml, "version": None},
                                          "packaging": {"found": True, "version": "26.4"}})


def test_no_python_is_refused_naming_the_path_and_the_fix():
    refused = fi.refusal(None, ("python3", "python"), "/usr/sbin:/usr/bin")
    assert "the image has no Python: none of python3, python is on its PATH (PATH=/usr/sbin:/usr/bin)" in str(refused)
    assert "install python3 (>= 3.10) with torch and transformers" in refused.fix


def test_python_3_9_is_refused_with_the_version_found():
    refused = fi.refusal(probe(version=(3, 9, 18)))
    assert "/usr/bin/python3 is Python 3.9.18, verify needs Python >= 3.10" in str(refused)
    assert "install python3 >= 3.10" in refused.fix


def test_python_2_is_refused_too():
    refused = fi.refusal(probe(version=(2, 7, 18), torch=False, transformers=False, executable="/usr/bin/python"))
    assert "Python 2.7.18" in str(refused) and "has no torch and no transformers" in str(refused)


def test_no_torch_is_refused_naming_it():
    refused = fi.refusal(probe(torch=False))
    assert str(refused) == "verify cannot run in this image: /usr/bin/python3 (Python 3.11.2) has no torch"
    assert "/usr/bin/python3 -m pip install torch" in refused.fix


def test_no_transformers_is_refused_naming_it():
    refused = fi.refusal(probe(transformers=False))
    assert str(refused).endswith("has no transformers") and "pip install transformers" in refused.fix


def test_neither_is_named_once_each():
    assert str(fi.refusal(probe(torch=False, transformers=False))).endswith("has no torch and no transformers")


def test_a_usable_image_is_not_refused_even_without_yaml():
    assert fi.refusal(probe(version=(3, 10, 0), yaml=False)) is None   # yaml travels with verify


def test_probe_output_is_parsed_from_its_marked_line_only():
    line = fi.PROBE_MARK + json.dumps({"executable": "/opt/venv/bin/python", "version": [3, 12, 1],
                                       "modules": {"torch": {"found": True, "version": "2.14.1"}}})
    parsed = fi.parse_probe(f"some banner\n{line}\nmore noise\n")
    assert parsed.executable == "/opt/venv/bin/python" and parsed.python == "3.12.1"
    assert parsed.has("torch") and not parsed.has("transformers") and parsed.version_of("torch") == "2.14.1"
    assert fi.parse_probe("Traceback (most recent call last):\n") is None
    assert fi.parse_probe(fi.PROBE_MARK + "{not json") is None


def test_the_probe_runs_on_python_2_syntax_and_reports_this_interpreter():
    out = subprocess.run([sys.executable, "-E", "-s", "-c", fi.PROBE, json.dumps([["json", "json"],
                                                                                ["no_such_mod_x", "x"]])],
                         capture_output=True, text=True, check=True).stdout
    parsed = fi.parse_probe(out)
    assert parsed.version[:2] == sys.version_info[:2]
    assert parsed.has("json") and not parsed.has("no_such_mod_x")
    compile(fi.PROBE, "probe", "exec")


def test_gpus_and_user_wording():
    assert fi.parse_gpus(None) is None and fi.parse_gpus("all") == -1 and fi.parse_gpus("2") == 2
    for bad in ("0", "-1", "two", "1;rm", "99999"):
        with pytest.raises(fi.AuditRefused):
            fi.parse_gpus(bad)
    assert fi.describe_user("").startswith("root: the image's config sets no User, so Docker runs it as root")
    assert fi.describe_user("10001:10001") == "10001:10001 (the image's config User)"


# -- what travels ---------------------------------------------------------------------------------

def test_verify_third_party_imports_are_found_and_only_helpers_travel():
    imports = vp.third_party_imports()
    assert {"torch", "transformers", "yaml"} <= set(imports)
    assert not set(imports) & (set(sys.stdlib_module_names) | set(vp.PROJECT_PACKAGES))
    carried = vp.to_carry(imports)
    assert "yaml" in carried and "torch" not in carried and "transformers" not in carried


def test_the_payload_is_pure_python_world_readable_and_removed():
    payload = vp.stage(("yaml",))
    try:
        assert (payload.src / "verify" / "cli.py").is_file()
        assert (payload.src / "families" / "qwen3_5_text.yaml").is_file()
        assert not list(payload.root.rglob("__pycache__"))
        files = [p for p in payload.deps.rglob("*") if p.is_file()]
        assert files and all(p.suffix in (".py", ".typed") for p in files)   # never this host's .so
        assert (payload.deps / "yaml" / "__init__.py").is_file()
        assert [c.distribution for c in payload.carried] == ["PyYAML"]
        for path in [payload.root, *payload.root.rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o755 if path.is_dir() else 0o644), path
    finally:
        payload.remove()
    assert not payload.root.exists()


def test_a_module_that_cannot_travel_is_named():
    with pytest.raises(vp.PayloadError) as err:
        vp.stage(("no_such_module_anywhere",))
    assert "neither the image nor this host has" in str(err.value)


def test_the_bootstrap_puts_verify_first_and_carried_modules_behind_the_image_site_packages(tmp_path):
    """Run the bootstrap with this interpreter: verify comes from the mount, a module only the
    payload has is importable, and a module the interpreter has itself (yaml) is its own."""
    root = tmp_path / "mnt"
    (root / "src" / "verify").mkdir(parents=True)
    (root / "src" / "verify" / "__init__.py").write_text("")
    (root / "src" / "verify" / "__main__.py").write_text(
        "import sys, yaml, only_in_payload\n"
        "print(sys.argv[1:], yaml.__file__, only_in_payload.WHERE, sys.modules['__main__'].__spec__.name)\n"
        "sys.exit(1)\n")
    (root / "deps" / "yaml").mkdir(parents=True)
    (root / "deps" / "yaml" / "__init__.py").write_text("raise ImportError('the carried copy must lose')")
    (root / "deps" / "only_in_payload.py").write_text("WHERE = 'payload'")
    code = fi.BOOTSTRAP.replace(fi.MOUNT, str(root))
    proc = subprocess.run([sys.executable, "-I", "-B", "-c", code, "--no-lock", "--json"], capture_output=True,
                          text=True)
    assert proc.returncode == 1, proc.stderr
    assert "['--no-lock', '--json']" in proc.stdout and "payload" in proc.stdout
    assert proc.stdout.split()[-1] == "verify.__main__"   # as `python -m verify`: a runtime guard stands aside
    assert str(root) not in proc.stdout.split()[2]     # the interpreter's own yaml won


def test_the_bootstrap_turns_a_crash_into_its_own_exit_code(tmp_path):
    code = fi.BOOTSTRAP.replace(fi.MOUNT, str(tmp_path))   # no verify there
    proc = subprocess.run([sys.executable, "-I", "-B", "-c", code], capture_output=True, text=True)
    assert proc.returncode == fi.VERIFY_CRASHED
    assert "verify could not run in this image: ImportError: No module named verify" in proc.stderr


# -- the run, against a fake engine ---------------------------------------------------------------

def image_info(user="", labels=None, path="/opt/venv/bin:/usr/bin:/bin"):
    return {"Id": "sha256:" + "ab" * 32, "Config": {"User": user, "Env": [f"PATH={path}"], "Labels": labels or {}}}


class Runner:
    """A fake image: which interpreters it has, what the probe sees, what verify prints."""

    def __init__(self, interpreters=("python3",), probe_result=None,
                 verify=(2, "CHECK | ...\nRESULT: FAIL (exit 2)\n")):
        self.interpreters = interpreters
        self.probe_result = probe_result or probe(executable="/opt/venv/bin/python3")
        self.verify = verify
        self.calls = []

    def __call__(self, image, command, **kw):
        self.calls.append({"image": image, "command": command, **kw})
        entry = kw["entrypoint"]
        if entry[1:4] == ["-E", "-s", "-c"]:
            if entry[0] not in self.interpreters:
                raise ContainerStartFailed("cannot start", explanation=f'exec: "{entry[0]}": executable file not '
                                           "found in $PATH: unknown")
            p = self.probe_result
            line = fi.PROBE_MARK + json.dumps({"executable": p.executable, "version": list(p.version),
                                               "modules": p.modules})
            return RunResult(0, line + "\n", line + "\n")
        mount = next(iter(kw["volumes"]))
        assert (Path(mount) / "src" / "verify" / "runner.py").is_file()   # staged while it runs
        self.mount = mount
        code, out = self.verify
        return RunResult(code, out + "\nsome warning on stderr", out)


def run_audit(engine, ref="other/img:1", **kw):
    said, printed = [], []
    code = fi.audit_image(engine, ref, say=said.append, emit=printed.append, **kw)
    return code, "\n".join(said), "".join(printed)


def test_audit_runs_verify_no_lock_read_only_no_network_as_the_image_user():
    runner = Runner()
    engine = FakeEngine(images={"other/img:1": image_info(user="1234:1234")}, on_run=runner)
    code, said, printed = run_audit(engine)
    assert code == 2 and printed.endswith("RESULT: FAIL (exit 2)\n")
    verify_call = runner.calls[-1]
    assert verify_call["command"] == ["--no-lock"]
    assert verify_call["entrypoint"][:4] == ["/opt/venv/bin/python3", "-I", "-B", "-c"]
    assert verify_call["network"] == "none" and verify_call["user"] == "1234:1234"
    assert list(verify_call["volumes"].values()) == [{"bind": fi.MOUNT, "mode": "ro"}]
    assert verify_call["environment"] == {"OMP_NUM_THREADS": "1"}   # the image's env, plus one torch thread
    assert all(c["network"] == "none" and c["user"] == "1234:1234" for c in runner.calls)
    assert not Path(runner.mount).exists()   # the temp folder is gone
    assert "not built by ftimage" in said and "1234:1234 (the image's config User)" in said
    assert "torch 2.13.0" in said


def test_no_user_means_root_and_it_is_said():
    runner = Runner()
    engine = FakeEngine(images={"other/img:1": image_info()}, on_run=runner)
    _, said, _ = run_audit(engine)
    assert runner.calls[-1]["user"] is None and "root: the image's config sets no User" in said


def test_python_is_found_as_python_when_python3_is_absent():
    runner = Runner(interpreters=("python",))
    engine = FakeEngine(images={"other/img:1": image_info()}, on_run=runner)
    run_audit(engine)
    assert [c["entrypoint"][0] for c in runner.calls[:2]] == ["python3", "python"]


def test_an_image_without_python_is_refused_and_verify_never_runs():
    runner = Runner(interpreters=())
    engine = FakeEngine(images={"other/img:1": image_info(path="/usr/bin:/bin")}, on_run=runner)
    with pytest.raises(fi.AuditRefused) as err:
        run_audit(engine)
    assert "no Python: none of python3, python is on its PATH (PATH=/usr/bin:/bin)" in str(err.value)
    assert len(runner.calls) == 2


def test_an_image_without_torch_is_refused_and_verify_never_runs():
    runner = Runner(probe_result=probe(torch=False))
    engine = FakeEngine(images={"other/img:1": image_info()}, on_run=runner)
    with pytest.raises(fi.AuditRefused, match="has no torch"):
        run_audit(engine)
    assert all(c["entrypoint"][1] == "-E" for c in runner.calls)


def test_a_missing_image_says_to_pull_it():
    with pytest.raises(fi.AuditRefused) as err:
        run_audit(FakeEngine(), "other/img:1")
    assert "not in this Docker engine" in str(err.value) and "`docker pull other/img:1`" in err.value.fix


def test_yaml_travels_only_when_the_image_lacks_it():
    runner = Runner(probe_result=probe(yaml=False, executable="/opt/venv/bin/python3"))
    engine = FakeEngine(images={"other/img:1": image_info()}, on_run=runner)
    _, said, _ = run_audit(engine)
    assert "carried behind the image's site-packages: PyYAML" in said
    runner = Runner()
    _, said, _ = run_audit(FakeEngine(images={"other/img:1": image_info()}, on_run=runner))
    assert "carried" not in said


def test_an_ftimage_image_is_audited_without_reading_its_lock():
    runner = Runner()
    engine = FakeEngine(images={"smoke:1": image_info(labels={"io.ftimage.lock.path": "/etc/ftimage/build.lock.json"})},
                        on_run=runner)
    _, said, _ = run_audit(engine, "smoke:1")
    assert "built by ftimage (its lock /etc/ftimage/build.lock.json is not read" in said
    assert "--no-lock" in runner.calls[-1]["command"]


def test_json_is_verify_report_and_its_exit_code_must_agree():
    report = json.dumps({"exit_code": 1, "results": []})
    runner = Runner(verify=(1, report))
    code, _, printed = run_audit(FakeEngine(images={"other/img:1": image_info()}, on_run=runner), json_report=True)
    assert code == 1 and json.loads(printed)["exit_code"] == 1
    assert runner.calls[-1]["command"] == ["--no-lock", "--json"]
    runner = Runner(verify=(0, report))
    with pytest.raises(fi.AuditRefused, match="report says exit 1, the container exited 0"):
        run_audit(FakeEngine(images={"other/img:1": image_info()}, on_run=runner), json_report=True)


def test_verify_that_could_not_start_is_exit_2_with_the_output():
    runner = Runner(verify=(fi.VERIFY_CRASHED, "ftimage-audit: verify could not run in this image: ImportError: x"))
    with pytest.raises(fi.AuditRefused, match="verify did not complete in the image"):
        run_audit(FakeEngine(images={"other/img:1": image_info()}, on_run=runner))


def test_gpus_and_model_are_passed_read_only(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    runner = Runner()
    run_audit(FakeEngine(images={"other/img:1": image_info()}, on_run=runner), gpus=-1, model=tmp_path)
    call = runner.calls[-1]
    assert call["gpus"] == -1 and call["command"] == ["--no-lock", "--model", fi.MODEL_MOUNT]
    assert call["volumes"][str(tmp_path.resolve())] == {"bind": fi.MODEL_MOUNT, "mode": "ro"}
    with pytest.raises(fi.AuditRefused, match="not a model directory"):
        run_audit(FakeEngine(images={"other/img:1": image_info()}, on_run=Runner()), model=tmp_path / "nope")


def test_cli_exit_codes_for_refusals(capsys):
    from build.cli.main import main

    assert main(["audit", "Not A Ref"]) == 2
    err = capsys.readouterr().err
    assert "is not a Docker image reference" in err and "Traceback" not in err
    assert main(["audit", "img", "--gpus", "zero"]) == 2
    assert "neither `all` nor a count" in capsys.readouterr().err
