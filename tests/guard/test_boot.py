"""The bootstrap every Python process of the image runs: cheap, silent, and on under `python -I`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import guard
from families import known_families, load_family
from guard import boot
from tests.guard.conftest import REPO, clean_env

HEAVY = ("torch", "transformers", "yaml", "re", "pathlib", "families", "contracts", "guard.activate")


@pytest.mark.unit
def test_install_files_is_one_pth_line_processed_after_the_app_pth():
    files = guard.install_files()
    assert list(files) == [guard.PTH_NAME] and files[guard.PTH_NAME] == b"import guard.boot; guard.boot.install()\n"
    # site processes a folder's .pth files in sorted order: the app dir is on sys.path first
    assert sorted([guard.APP_PTH, *files]) == [guard.APP_PTH, *files]


@pytest.mark.unit
def test_the_bootstrap_imports_nothing_heavy():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); before = set(sys.modules); "
            "import guard.boot; guard.boot.install(); "
            "added = sorted(set(sys.modules) - before); import json; print(json.dumps(added))")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(REPO)], capture_output=True, text=True, check=True)
    added = json.loads(proc.stdout)
    assert "guard.boot" in added
    assert not [m for m in added if m.split(".")[0] in HEAVY or m in HEAVY], added


@pytest.mark.unit
def test_the_watched_modules_are_the_families_modeling_modules():
    assert boot.watched_modules() == {load_family(n).modeling_module: n for n in known_families()}
    assert boot.watched_modules("/nonexistent") == {}


@pytest.mark.unit
def test_the_watcher_fires_once_the_module_has_executed(tmp_path, monkeypatch):
    pkg = tmp_path / "ftimage_fake_modeling"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "modeling.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    watcher = boot.ModelingWatcher({"ftimage_fake_modeling.modeling": "fam"},
                                   on_loaded=lambda m, f: seen.append((m.VALUE, f)))
    monkeypatch.setattr(sys, "meta_path", [watcher, *sys.meta_path])
    import ftimage_fake_modeling.modeling as module

    assert seen == [(42, "fam")]
    assert "exec_module" not in vars(module.__loader__)     # the loader is the plain one again
    monkeypatch.delitem(sys.modules, "ftimage_fake_modeling.modeling")
    import ftimage_fake_modeling.modeling  # noqa: F401, F811 - a second import does not fire again
    assert len(seen) == 1


@pytest.mark.unit
def test_the_venv_pth_installs_the_watcher_and_python_c_pass_says_nothing(venv_python):
    code = ("import sys; from guard.boot import ModelingWatcher; "
            "print(any(isinstance(f, ModelingWatcher) for f in sys.meta_path), 'torch' in sys.modules)")
    for flags in ([], ["-I"]):             # site-packages .pth files are processed under -I too
        proc = subprocess.run([str(venv_python), *flags, "-c", code], capture_output=True, text=True,
                              env=clean_env(), cwd="/")
        assert proc.returncode == 0 and proc.stdout.split() == ["True", "False"], proc.stderr
    for env in ({}, {"FTIMAGE_GUARD": "off"}, {"FTIMAGE_GUARD_STEPS": "two"}):
        proc = subprocess.run([str(venv_python), "-I", "-c", "pass"], capture_output=True, text=True,
                              env=clean_env(**env), cwd="/")
        assert proc.returncode == 0 and proc.stdout == proc.stderr == "", (env, proc.stderr)


def boot_cost_ms(python) -> float:
    """The bootstrap's cumulative import time (python -X importtime), for the record."""
    proc = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                          env=clean_env(), cwd="/")
    rows = [line.split("|") for line in proc.stderr.splitlines() if line.rstrip().endswith("guard.boot")]
    return int(rows[0][1]) / 1000 if rows else float("nan")


@pytest.mark.training
def test_activation_quiet_when_on_logged_once_when_off_and_a_bad_step_count_is_one_error(scenario):
    on = scenario(trainer="import")
    assert on.rc == 0 and "ACTIVE True" in on.stdout and "ftimage-guard" not in on.stderr, on.stderr
    off = scenario(trainer="import", env={"FTIMAGE_GUARD": "off"})
    assert off.rc == 0 and "ACTIVE False" in off.stdout, off.stderr
    assert off.stderr.count("ftimage-guard") == 1 and "ftimage-guard: off (FTIMAGE_GUARD=off)" in off.stderr
    assert off.report()["status"] == "off"
    bad = scenario(trainer="import", env={"FTIMAGE_GUARD_STEPS": "2x"})
    assert bad.rc == 2 and "Traceback" not in bad.stderr and "ACTIVE" not in bad.stdout
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert lines[-2].startswith("error: ftimage-guard: FTIMAGE_GUARD_STEPS='2x' is not a whole number"), bad.stderr
    assert lines[-1].startswith("  fix: ")


@pytest.mark.unit
def test_the_bootstrap_import_time_is_recorded(venv_python):
    """Recorded, not asserted as a timing: the assertion is that it imports nothing heavy (above)."""
    print(f"guard.boot import: {boot_cost_ms(venv_python):.2f} ms (python -X importtime)")


@pytest.mark.unit
def test_importing_the_bootstrap_installs_nothing():
    """Only the .pth line installs the watcher: a process (a test run, a tool) that imports the
    module stays unguarded."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import guard.boot; "
            "print(any(type(f).__name__ == 'ModelingWatcher' for f in sys.meta_path))")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(REPO)], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"
