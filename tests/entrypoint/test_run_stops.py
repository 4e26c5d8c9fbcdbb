"""A stop request is never lost, and a run is complete only when everything it promises is
published. Real 2-rank CPU runs of the tiny model; FTIMAGE_TEST_HOLD (stop_request.py) holds the
workers in a window a few milliseconds wide otherwise, so each signal or kill lands where it must."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from entrypoint.checkpoint.dcp import list_checkpoints
from entrypoint.launcher.stop_request import HOLD_ENV, STOP_DIR_ENV
from tests.fixtures.chat import (
    REPO,
    entrypoint_env,
    finetune_metrics,
    run_entrypoint,
    run_finetune,
    synthetic_conversations,
    write_jsonl,
)
from tests.fixtures.processes import descendants

LONG_EVAL = ("data.eval_fraction=0.1", "train.eval_every=2", "eval.samples=1024", "eval.max_new_tokens=4096")


def _start(fixture_dir, out: Path, log: Path, *overrides: str, hold: str = "") -> subprocess.Popen:
    env = entrypoint_env(**({HOLD_ENV: hold} if hold else {}))
    return subprocess.Popen([sys.executable, "-m", "entrypoint", "finetune", "--config", str(fixture_dir.config),
                             "--allow-fallback", f"output.dir={out}", *overrides],
                            cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_until(ready, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def _held(gate: Path, phase: str) -> bool:
    return all((gate / f"{phase}-reached-{rank}").exists() for rank in (0, 1))


def _report(out: Path) -> dict:
    return json.loads((out / "run_report.json").read_text())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")   # a zombie has exited: only its parent has not reaped it


@pytest.mark.training
def test_sigterm_before_the_workers_are_ready_reaches_them_when_they_are(fixture_dir, tmp_path):
    out, gate, log = tmp_path / "out", tmp_path / "gate", tmp_path / "run.log"
    gate.mkdir()
    proc = _start(fixture_dir, out, log, "train.max_steps=400", "checkpoint.every=0", "checkpoint.export=false",
                  hold=f"handlers:{gate}")
    _wait_until(lambda: "launching:" in log.read_text(), proc, log)
    proc.send_signal(signal.SIGTERM)     # the workers do not exist yet, or have no handler yet
    _wait_until(lambda: "stop requested (SIGTERM)" in log.read_text() and _held(gate, "handlers"), proc, log)
    (gate / "handlers-go").touch()       # now they install their handlers, and find the request
    assert proc.wait(timeout=180) == 143, log.read_text()[-3000:]
    text = log.read_text()
    assert "still starting stop as soon as they are ready" in text and "Traceback" not in text
    # seen by the first check after the model loaded: not a step trained, not a checkpoint written
    assert "stop requested while loading the model: the run ends before step 1" in text
    report = _report(out)
    assert report["status"] == "interrupted" and report["stop_signal"] == "SIGTERM" and report["final_step"] == 0
    assert report["stopped_while_loading"] == "the model" and finetune_metrics(out) == []
    assert list_checkpoints(out / "checkpoints") == []
    assert not list((out / ".launch").glob("stop-*"))   # the launch's stop folder goes with it


@pytest.mark.training
@pytest.mark.parametrize("phase", ["loaded", "resumed"])
def test_sigterm_while_loading_ends_the_run_before_a_step_and_saves_nothing(fixture_dir, tmp_path, phase):
    """Held where the model has loaded (a fresh run) or the checkpoint has (a resumed one): the ranks
    agree on the stop there, rather than at the end of a step they should not have trained."""
    out, gate, log = tmp_path / "out", tmp_path / "gate", tmp_path / "run.log"
    gate.mkdir()
    common = ("checkpoint.every=1", "checkpoint.export=false")
    saved = []
    if phase == "resumed":
        first = run_finetune(fixture_dir, out, "train.max_steps=2", *common)
        assert first.returncode == 0, first.stderr[-3000:]
        saved = ["step-00000001", "step-00000002"]
    proc = _start(fixture_dir, out, log, "train.max_steps=4", "checkpoint.allow_changed=[train.max_steps]", *common,
                  hold=f"{phase}:{gate}")
    _wait_until(lambda: _held(gate, phase), proc, log)
    tree = descendants(proc.pid)         # the agent and both workers
    proc.send_signal(signal.SIGTERM)
    _wait_until(lambda: "stop requested (SIGTERM)" in log.read_text(), proc, log)
    (gate / f"{phase}-go").touch()
    assert proc.wait(timeout=180) == 143, log.read_text()[-3000:]
    text = log.read_text()
    what, step = ("the model", 0) if phase == "loaded" else ("checkpoint step-00000002", 2)
    assert f"stop requested while loading {what}: the run ends before step {step + 1}" in text
    assert f"stopped by SIGTERM while loading {what}, before step {step + 1}: nothing trained, nothing saved" in text
    assert "Traceback" not in text and f"step {step + 1}/4" not in text   # no step was trained
    report = _report(out)
    assert report["status"] == "interrupted" and report["final_step"] == step
    assert report["stopped_while_loading"] == what and report["stop_signal"] == "SIGTERM"
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == saved   # nothing new written
    assert [m["step"] for m in finetune_metrics(out)] == [1, 2][:step]
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in tree):
        assert time.monotonic() < deadline, [p for p in tree if _alive(p)]
        time.sleep(0.1)


@pytest.mark.training
def test_sigterm_during_a_long_generation_stops_it_with_a_checkpoint(fixture_dir, tmp_path):
    out, log = tmp_path / "out", tmp_path / "run.log"
    # 1024 samples x 4096 new tokens: hours of lockstep generation on CPU, unless the stop is checked
    proc = _start(fixture_dir, out, log, "train.max_steps=400", "checkpoint.every=0", "checkpoint.export=false",
                  *LONG_EVAL)
    _wait_until(lambda: "eval step 2: loss" in log.read_text(), proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    report = _report(out)
    assert report["status"] == "interrupted" and report["final_step"] == 2
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-00000002"]
    assert not (out / "samples.jsonl").exists()   # the evaluation was cut short, not written half


@pytest.mark.training
def test_workers_do_not_outlive_a_launcher_killed_during_generation(fixture_dir, tmp_path):
    out, log = tmp_path / "out", tmp_path / "run.log"
    proc = _start(fixture_dir, out, log, "train.max_steps=400", "checkpoint.every=0", "checkpoint.export=false",
                  *LONG_EVAL)
    _wait_until(lambda: "eval step 2: loss" in log.read_text(), proc, log)
    tree = descendants(proc.pid)        # the agent and both workers
    assert len(tree) >= 3, tree
    proc.kill()                          # SIGKILL: the launcher has no last word
    proc.wait(timeout=30)
    deadline = time.monotonic() + 120
    while any(_alive(p) for p in tree):
        assert time.monotonic() < deadline, (tree, log.read_text()[-3000:])
        time.sleep(0.1)
    # they left the generation on their own, with a checkpoint, rather than being killed in it
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-00000002"]


@pytest.mark.training
def test_sigterm_during_the_final_export_finishes_it_then_exits_143(fixture_dir, tmp_path):
    out, gate, log = tmp_path / "out", tmp_path / "gate", tmp_path / "run.log"
    gate.mkdir()
    common = ("train.max_steps=2", "checkpoint.every=0", "checkpoint.export=true")
    proc = _start(fixture_dir, out, log, *common, hold=f"export:{gate}")
    _wait_until(lambda: _held(gate, "export"), proc, log)
    assert (out / ".tmp-final").is_dir() and not (out / "final").exists()
    proc.send_signal(signal.SIGTERM)
    _wait_until(lambda: "stop requested (SIGTERM)" in log.read_text(), proc, log)
    (gate / "export-go").touch()
    assert proc.wait(timeout=180) == 143, log.read_text()[-3000:]
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    assert not (out / ".tmp-final").exists()
    report = _report(out)
    assert report["status"] == "completed" and report["final_step"] == 2 and report["stop_signal"] == "SIGTERM"
    assert report["exported"] == str(out / "final")
    assert "SIGTERM came while the run was finishing: it finished first" in log.read_text()
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "--allow-fallback", f"output.dir={out}",
                        *common], timeout=240)
    assert r.returncode == 0 and "already complete" in r.stderr + r.stdout, r.stderr[-3000:]


@pytest.mark.training
def test_a_kill_during_the_final_export_is_finished_by_the_rerun(fixture_dir, tmp_path):
    out, gate, log = tmp_path / "out", tmp_path / "gate", tmp_path / "run.log"
    gate.mkdir()
    common = ("train.max_steps=2", "checkpoint.every=0", "checkpoint.export=true")
    proc = _start(fixture_dir, out, log, *common, hold=f"export:{gate}")
    _wait_until(lambda: _held(gate, "export"), proc, log)
    for pid in [proc.pid, *descendants(proc.pid)]:   # kill -9, the whole tree at once: a node dying
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert (out / ".tmp-final").is_dir() and not (out / "final").exists()
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-00000002"]   # the final one

    args = ["finetune", "--config", str(fixture_dir.config), "--allow-fallback", f"output.dir={out}", *common]
    r = run_entrypoint(args, timeout=240)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    assert "step-00000002 is the run's final checkpoint, but final/ (the HF export) was never published" in text
    assert f"resumed from {out / 'checkpoints' / 'step-00000002'} at step 2" in text
    assert (out / "final" / "config.json").is_file() and not (out / ".tmp-final").exists()
    report = _report(out)
    assert report["status"] == "completed" and report["final_step"] == 2 and report["exported"] == str(out / "final")
    assert report["final_loss"] == finetune_metrics(out)[-1]["loss"]   # the loss the last step logged
    assert [m["step"] for m in finetune_metrics(out)] == [1, 2]         # no step trained again
    r = run_entrypoint(args, timeout=240)
    assert r.returncode == 0 and "already complete" in r.stdout + r.stderr, r.stderr[-3000:]


@pytest.mark.training
def test_sigterm_before_launching_ends_the_launcher_there(fixture_dir, tmp_path):
    out, log = tmp_path / "out", tmp_path / "run.log"
    proc = _start(fixture_dir, out, log, "checkpoint.export=false")
    _wait_until(lambda: "running verify" in log.read_text(), proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    text = log.read_text()
    assert "stopped by SIGTERM before any worker started" in text and "Traceback" not in text
    assert "launching:" not in text and not (out / "checkpoints").exists()


@pytest.mark.training
def test_sigterm_while_tokenizing_leaves_no_process_and_no_half_written_corpus(fixture_dir, tmp_path):
    out, log, data = tmp_path / "out", tmp_path / "run.log", tmp_path / "big.jsonl"
    write_jsonl(data, synthetic_conversations(30000, seed=1))   # seconds of tokenizing, even on two processes
    proc = _start(fixture_dir, out, log, f"data.path={data}", "data.num_proc=2", "checkpoint.export=false")
    cache = out / ".cache" / "corpus"
    # the pool is up and writing into the staging folder: the stop lands in the middle of Dataset.map
    _wait_until(lambda: any(p.is_file() for p in cache.glob(".tmp-tokenized-*/*")), proc, log, timeout=300)
    tree = descendants(proc.pid)        # the tokenizer processes
    assert len(tree) >= 2, tree
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    text = log.read_text()
    assert "stopped by SIGTERM before any worker started" in text and "launching:" not in text
    assert "Traceback" not in text, text[-3000:]   # nor from a tokenizer process the pool ended
    assert not list(cache.glob(".tmp-*")) and not list(cache.glob("tokenized-*"))   # cut short: nothing kept
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in tree):
        assert time.monotonic() < deadline, [p for p in tree if _alive(p)]
        time.sleep(0.1)


@pytest.mark.unit
def test_a_worker_checks_in_then_reads_the_stop_recorded_before_it_was_ready(tmp_path):
    worker = ("from entrypoint.launcher.stop_request import StopRequest\n"
              "stop = StopRequest()\nprint(stop.signal_name if stop() else 'run')\n")
    for recorded, expected in ((None, "run"), ("15", "SIGTERM"), ("2", "SIGINT")):
        box = tmp_path / f"box-{recorded}"
        box.mkdir()
        if recorded:
            (box / "stop").write_text(recorded)
        proc = subprocess.run([sys.executable, "-c", worker], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, STOP_DIR_ENV: str(box)})
        assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stderr[-2000:]
        assert [p.name.startswith("ready-") for p in box.iterdir() if p.name != "stop"] == [True]


@pytest.mark.unit
def test_the_launcher_raises_on_a_stop_before_hand_over_and_records_one_after():
    from entrypoint.launcher.supervise import StopBeforeLaunch, Stops

    before = signal.getsignal(signal.SIGTERM)
    with Stops() as stops:
        with pytest.raises(StopBeforeLaunch) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert raised.value.signum == signal.SIGTERM
    with Stops() as stops:
        stops.hand_over()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stops.received == [signal.SIGTERM, signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the swallowing, on purpose
def test_a_stop_whose_exception_python_swallowed_still_ends_the_launch_at_hand_over():
    """The handler raises wherever the main thread is; where Python prints an exception and goes on
    (a finaliser here, a fork handler while the tokenizer pool starts), the stop must not be lost."""
    from entrypoint.launcher.supervise import StopBeforeLaunch, Stops

    class Finaliser:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)   # the handler runs, and raises, in here

    with Stops() as stops:
        Finaliser()   # dropped at once: "Exception ignored in ...", and the launch goes on
        with pytest.raises(StopBeforeLaunch) as raised:
            stops.hand_over()
    assert raised.value.signum == signal.SIGTERM and not stops.handing_over


@pytest.mark.unit
def test_a_forked_helper_ends_on_the_signal_instead_of_raising_the_launchers_stop():
    """datasets' pool forks the launcher, handler and all; the pool ends its processes with SIGTERM."""
    from entrypoint.launcher.supervise import Stops

    with Stops():
        child = os.fork()
        if child == 0:   # never back into the test runner: any way out but the signal is exit 3
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            finally:
                os._exit(3)
        _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
