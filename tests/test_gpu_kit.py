"""The GPU proof kit's own machinery, on CPU: phase limits that fire (process group and
grandchildren killed), results that merge across runs, a results folder that cannot be written,
and the Triton payload's checks."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bench.kit_runner import TIMED_OUT, ResultsNotWritable, Runner

pytestmark = pytest.mark.unit

# a phase that starts a grandchild in its own session (as torchrun does with its workers), then
# outlives its limit; both would leave a marker file if they lived on
SLOW = """
import os, subprocess, sys, time
marker = sys.argv[1]
subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(6); open({marker!r} + '.grandchild', 'w')"],
                 start_new_session=True)
print("started", flush=True)
time.sleep(6)
open(marker + ".child", "w")
"""


@pytest.mark.slow
def test_a_phase_over_its_limit_is_killed_with_its_grandchildren(tmp_path):
    runner = Runner(tmp_path / "results", deadline_s=600, echo=lambda _l: None)
    marker = tmp_path / "marker"
    code = runner.run("slow", [sys.executable, "-c", SLOW, str(marker)], timeout=2)
    assert code == TIMED_OUT
    record = json.loads((tmp_path / "results" / "phases.json").read_text())["slow"]
    assert record["timed_out"] is True and record["exit_code"] == TIMED_OUT
    time.sleep(7)     # longer than either would have taken: neither may have written its marker
    assert not Path(str(marker) + ".child").exists() and not Path(str(marker) + ".grandchild").exists()
    assert "started" in (tmp_path / "results" / "kit.log").read_text()


def test_the_overall_deadline_caps_every_phase_and_results_merge_across_runs(tmp_path):
    results = tmp_path / "results"
    first = Runner(results, deadline_s=600, echo=lambda _l: None)
    assert first.run("quick", [sys.executable, "-c", "print('ok')"], timeout=60) == 0
    assert first.run("late", [sys.executable, "-c", "import time; time.sleep(30)"], timeout=1) == TIMED_OUT
    second = Runner(results, deadline_s=3, echo=lambda _l: None)
    assert second.done("quick") and not second.done("late")      # a second run finishes what is left
    assert second.run("late", [sys.executable, "-c", "print(1)"], timeout=60) == TIMED_OUT   # < 5 s left
    assert json.loads((results / "phases.json").read_text())["late"]["skipped"] == "out of time"


def test_a_results_folder_that_is_not_writable_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ResultsNotWritable) as info:
        Runner(tmp_path / "file" / "results", deadline_s=60, echo=lambda _l: None)
    assert "--results" in info.value.fix


def test_the_triton_payload_is_checked_before_use(tmp_path, monkeypatch):
    import lzma
    import tarfile

    from bench import kit_triton

    kit = tmp_path / "kit"
    (kit / "triton").mkdir(parents=True)
    tree = tmp_path / "tree" / "triton"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("__version__ = '3.7.1'\n")
    with lzma.open(kit / "triton" / "triton.tar.xz", "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.add(tree / "__init__.py", arcname="triton/__init__.py")
    host = tmp_path / "host" / "triton" / "backends" / "nvidia" / "bin"
    host.mkdir(parents=True)
    (host / "ptxas").write_bytes(b"ptxas 12.8")
    manifest = {"payload": "triton.tar.xz", "payload_sha256": kit_triton.sha256(kit / "triton" / "triton.tar.xz"),
                "files": {"triton/__init__.py": kit_triton.sha256(tree / "__init__.py")},
                "host_reused": {"triton/backends/nvidia/bin/ptxas": kit_triton.sha256(host / "ptxas")}}
    (kit / "triton" / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(kit_triton, "host_triton_dir", lambda _python: tmp_path / "host" / "triton")
    env = kit_triton.stage(kit, tmp_path / "site", sys.executable)
    assert (tmp_path / "site" / "triton" / "__init__.py").is_file()
    assert env["TRITON_PTXAS_PATH"] == str(host / "ptxas")
    assert kit_triton.stage(kit, tmp_path / "site", sys.executable) == env     # idempotent
    (host / "ptxas").write_bytes(b"ptxas 12.9")
    with pytest.raises(kit_triton.KitTritonError, match="differs"):
        kit_triton.stage(kit, tmp_path / "site", sys.executable)
    (host / "ptxas").write_bytes(b"ptxas 12.8")
    with open(kit / "triton" / "triton.tar.xz", "ab") as fh:
        fh.write(b"tampered")
    with pytest.raises(kit_triton.KitTritonError, match="does not match its sha256"):
        kit_triton.stage(kit, tmp_path / "other-site", sys.executable)
    assert not os.path.exists(tmp_path / "other-site")


def test_a_retried_training_phase_starts_from_no_earlier_run(tmp_path):
    # an earlier attempt's metrics would make the SIGTERM fire before the new run installs its
    # handler (exit -15 instead of 143) and its checkpoints would be resumed as if this run wrote them
    from bench.kit_finetune import RUNS, clear_runs, metrics

    for name in RUNS:
        (tmp_path / name / "checkpoints" / "step-00000007").mkdir(parents=True)
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 8, "loss": 1.0}) + "\n")
        (tmp_path / f"{name}.log").write_text("old\n")
    (tmp_path / "model-bench").mkdir()
    (tmp_path / "model-bench" / "config.json").write_text("{}")
    clear_runs(tmp_path)
    for name in RUNS:
        assert metrics(tmp_path / name) == [] and not (tmp_path / name).exists()
        assert not (tmp_path / f"{name}.log").exists()
    assert (tmp_path / "model-bench" / "config.json").is_file()      # the inputs are kept


# What the GPU host's Python does not have and the kit does not carry (bench/gpu_proof.py
# CARRIED_WHEELS carries pyelftools and datasets): the image-building side of the project needs
# these, the kit's phases must not.
NOT_ON_GPU_HOST = ("cryptography", "docker", "cyclonedx", "packageurl", "installer", "wandb", "mlflow")
KIT_IMPORTS = """
import importlib, importlib.abc, pkgutil, sys
blocked = set(sys.argv[1].split(","))

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU host)")
        return None

sys.meta_path.insert(0, Absent())
failed = []
names = ["build.cli.main", "build.cli.kernels", "build.kernels.build_here", "bench.gpu_proof", "bench.kit_finetune",
         "bench.gpu_bench", "bench.kit_family", "bench.family_bench"]
for package in ("entrypoint", "verify", "families", "contracts"):
    module = importlib.import_module(package)
    names += [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")
              if not m.name.endswith("__main__")]     # running it would start the CLI
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_what_the_kit_runs_imports_nothing_the_gpu_host_lacks():
    # a module-level `import cryptography` in the build CLI stopped `kernels build-here` (the
    # kit's compile phase) on the GPU host before it compiled anything
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", KIT_IMPORTS, ",".join(NOT_ON_GPU_HOST)], cwd=repo,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


def test_the_kit_carries_datasets_at_the_images_pin():
    # finetune reads its data through `datasets`, which the GPU host does not have
    from bench.gpu_proof import CARRIED_WHEELS, RUNTIME_MODULES

    spec = Path(__file__).resolve().parents[1] / "images" / "qwen27b" / "image.yaml"
    pins = [line.split("#")[0].strip().lstrip("- ").strip() for line in spec.read_text().splitlines()]
    assert "datasets" in RUNTIME_MODULES
    assert next(p for p in pins if p.startswith("datasets==")) in CARRIED_WHEELS


# --- one kit phase per model family, and the family bench's CPU smoke mode -------------------------

def test_the_kit_has_one_phase_per_family_after_its_own_phases_each_under_its_limit(tmp_path, monkeypatch):
    import bench.gpu_proof as kit
    from bench.kit_runner import Runner
    from families import known_families

    expected = sorted(f"family:{name}" for name in known_families())
    assert sorted(kit.family_phases()) == expected, \
        "every family in families/ needs its own kit phase (bench/kit_family.py family_priority)"
    ran = []

    def fake_run(self, phase, argv, *, timeout, **_kw):
        ran.append((phase, timeout, argv))
        self.record(phase, seconds=0.0, exit_code=0)
        return 0

    monkeypatch.setattr(Runner, "run", fake_run)
    monkeypatch.setattr(kit, "machine", lambda _kit: {"gpu": "none", "commit": "test"})
    monkeypatch.setattr(kit, "stage", lambda _kit: True)
    results = tmp_path / "results"
    results.mkdir()
    verdicts = {known_families()[0]: "PASS", known_families()[-1]: "FAIL"}
    for name, verdict in verdicts.items():
        (results / f"family-{name}.json").write_text(json.dumps({
            "family": name, "verdict": verdict, "why": "" if verdict == "PASS" else "dispatch.x: torch reference path",
            "bench": {"ratios": {"ops_fallback_over_fused (padded)": 3.5}}}))
    assert kit.main(["--rehearse", "--results", str(results)]) == 0
    phases = [phase for phase, _, _ in ran]
    assert phases[:3] == ["verify", "finetune", "bench"]          # compile and refusal need a GPU
    assert sorted(phases[3:]) == expected and phases[3:] == kit.family_phases()
    assert all(timeout == kit.LIMITS["family"] for phase, timeout, _ in ran if phase.startswith("family:"))
    assert all("--rehearse" in argv for phase, _, argv in ran if phase.startswith("family:"))
    summary = (results / "summary.txt").read_text()
    for name in known_families():
        line = next(ln for ln in summary.splitlines() if ln.startswith(f"{name} "))
        assert verdicts.get(name, "NOT RUN") in line, line
    assert "3.50x" in summary


def test_a_family_added_to_families_gets_a_kit_phase_without_a_list_to_edit(monkeypatch):
    import families
    from bench.gpu_proof import family_phases

    real_known, real_load = families.known_families, families.load_family
    monkeypatch.setattr(families, "known_families", lambda: (*real_known(), "lfm2_copy"))
    monkeypatch.setattr(families, "load_family", lambda name: real_load("lfm2" if name == "lfm2_copy" else name))
    phases = family_phases()
    assert "family:lfm2_copy" in phases and len(phases) == len(real_known()) + 1
    assert phases[0] == "family:qwen3_5_text"     # the kit image's own family first


def test_a_family_verdict_needs_dispatch_isolation_and_a_bench_with_every_kernel_bound():
    from bench.kit_family import verdict

    row = lambda check, status: {"check": check, "status": status, "detail": f"{check} {status}", "fix": ""}  # noqa: E731
    runs = {"runs": {"packed": {}, "padded": {}}}
    bench = {"fused": {**runs, "bindings": {"causal_conv1d_fn": {"kernel": True}}}, "fallback": runs}
    rows = [row("lock", "PASS"), row("model_fit.head_dim", "FAIL"), row("dispatch.causal_conv1d_fn", "PASS"),
            row("isolation.conv", "PASS")]
    assert verdict({"rows": rows, "bench": bench}) == ("PASS", "")    # model_fit explains; sdpa bench
    assert verdict({"rows": rows[:2], "bench": bench})[0] == "FAIL"
    assert verdict({"rows": [*rows, row("isolation.ssd", "FAIL")], "bench": bench})[1].startswith("isolation.ssd")
    assert "did not run" in verdict({"rows": rows, "bench": {**bench, "fallback": {}}})[1]
    fell_back = {**bench, "fused": {**runs, "bindings": {"causal_conv1d_fn": {"kernel": False}}}}
    assert "fell back for causal_conv1d_fn" in verdict({"rows": rows, "bench": fell_back})[1]


@pytest.mark.slow
def test_the_family_bench_cpu_smoke_counts_ops_fused_and_fallback_packed_and_padded(tmp_path):
    # falcon_h1: a Mamba2 hybrid; qwen3_5_moe: a MoE (GDN) hybrid. Two worker processes, one per mode.
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "family_bench.json"
    proc = subprocess.run([sys.executable, "bench/family_bench.py", "--device", "cpu", "--flavour", "tiny",
                           "--families", "falcon_h1,qwen3_5_moe", "--json-out", str(out)], cwd=repo,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "doubles" in proc.stdout and "not kernels" in proc.stdout and "mean nothing" in proc.stdout
    results = json.loads(out.read_text())
    assert results["device"] == "cpu" and results["doubles"] is True and "mean nothing" in results["note"]
    assert sorted(results["families"]) == ["falcon_h1", "qwen3_5_moe"]
    for name, fam in results["families"].items():
        ops = fam["ratios"]["ops_per_step"]
        for mode in ("fused", "fallback"):
            for scheme in ("packed", "padded"):
                assert ops[mode][scheme] > 0, (name, mode, scheme)
                run = fam[mode]["runs"][scheme]
                assert ops[mode][scheme] == run["aten_ops_per_step"] - run["aten_ops_inside_kernels_per_step"] \
                    + run["kernel_calls_per_step"]
            assert f"== {name}:" in proc.stdout
        for scheme in ("packed", "padded"):
            assert ops["fallback"][scheme] > ops["fused"][scheme], (name, scheme, ops)
            assert fam["fused"]["runs"][scheme]["kernel_calls_per_step"] > 0
            assert fam["fallback"]["runs"][scheme]["kernel_calls_per_step"] == 0
        assert all(b["kernel"] for b in fam["fused"]["bindings"].values())        # the doubles were bound
        assert not any(b["kernel"] for b in fam["fallback"]["bindings"].values())  # and hidden
