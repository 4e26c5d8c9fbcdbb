"""The guard activated as the image activates it: a venv (seeing this machine's torch,
transformers and TRL through --system-site-packages) whose site-packages holds the build's
`ftimage-app.pth` (here: the repo root) and the files `guard.install_files()` returns."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import guard

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTIMAGE_") and k != "PYTHONPATH"}
    env.update({"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    env.update(extra)
    return env


def make_venv(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site = Path(purelib)
    (site / guard.APP_PTH).write_text(f"{REPO}\n")
    for name, data in guard.install_files().items():
        (site / name).write_bytes(data)
    return python


@pytest.fixture(scope="session")
def venv_python(tmp_path_factory) -> Path:
    return make_venv(tmp_path_factory.mktemp("guard-venv") / "venv")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    from tests.fixtures.chat import synthetic_conversations, write_tokenizer

    directory = tmp_path_factory.mktemp("guard-tokenizer")
    rows = synthetic_conversations(64, seed=1)
    write_tokenizer(directory, [m["content"] for r in rows for m in r["messages"]])
    return str(directory)


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    workdir: Path

    def report(self, name: str = "guard.json") -> dict:
        return json.loads((self.workdir / name).read_text())


class ForkServer:
    def __init__(self, python: Path, home: Path):
        # -I as the image runs python: the guard's .pth must work in isolated mode
        self.proc = subprocess.Popen([str(python), "-I", "-u", str(HERE / "forkserver.py")], cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=clean_env(HF_HOME=str(home)))
        ready = self.proc.stdout.readline()
        assert ready.strip() == '{"ready": true}', ready

    def run(self, spec: dict, workdir: Path) -> Run:
        self.proc.stdin.write(json.dumps({"spec": spec, "workdir": str(workdir)}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return Run(answer["rc"], (workdir / "stdout.txt").read_text(), (workdir / "stderr.txt").read_text(), workdir)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def forkserver(venv_python, tmp_path_factory):
    server = ForkServer(venv_python, tmp_path_factory.mktemp("guard-home"))
    yield server
    server.close()


@pytest.fixture
def scenario(forkserver, tokenizer_dir, tmp_path):
    """Run one spec (tests/guard/scenarios.py) in a fresh forked process; its report lands in
    tmp_path/guard.json."""
    def run(env: dict | None = None, **spec) -> Run:
        spec.setdefault("tokenizer", tokenizer_dir)
        spec["env"] = {"FTIMAGE_GUARD_REPORT": str(tmp_path / "guard.json"), **(env or {})}
        return forkserver.run(spec, tmp_path)
    return run
