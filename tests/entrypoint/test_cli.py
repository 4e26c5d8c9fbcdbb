"""CLI dispatch, info, config errors, the verify gate and launch topology (no training)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from contracts.finetune_config import ConfigError, FinetuneConfig, build_config
from entrypoint.launcher.torchrun import LaunchError, resolve_topology
from tests.fixtures.chat import entrypoint_env, run_entrypoint

pytestmark = pytest.mark.unit


def test_other_argv_is_execd_as_a_plain_command():
    r = run_entrypoint(["id", "-u"])
    assert r.returncode == 0 and r.stdout.strip() == str(os.getuid())
    r = run_entrypoint(["sh", "-c", "exit 7"])
    assert r.returncode == 7  # the command's own exit code, not ours


def test_unknown_command_says_what_to_do():
    r = run_entrypoint(["no-such-program-xyz"])
    assert r.returncode == 127
    assert "command not found: no-such-program-xyz" in r.stderr and "finetune" in r.stderr
    assert "Traceback" not in r.stderr


def test_shell_runs_a_shell():
    r = run_entrypoint(["shell", "-c", "echo $0"])
    assert r.returncode == 0 and r.stdout.strip().endswith(("bash", "sh"))


def _lock(tmp_path):
    from contracts.lock import BuildLock, LockedKernel

    kernel = LockedKernel(name="causal-conv1d", distribution="causal-conv1d", version="1.7.0", kind="cuda-extension",
                          import_name="causal_conv1d",
                          key="ab" * 32, wheel="causal_conv1d-1.7.0-cp311-linux_x86_64.whl", sha256="cd" * 32,
                          archs=("sm_90",))
    lock = BuildLock(image="qwen-test", plan_key="ef" * 32, python="3.11", torch="2.13.0+cu130", cuda="13.0",
                     cxx11_abi=True, compiler="gcc-12", transformers="5.18.0", model_family="qwen3_5_text",
                     target_archs=("sm_90",), attn_implementation="flash_attention_2", kernels=(kernel,),
                     finetune_defaults={"packing": {"budget": 4096}, "train.lr": 1e-4})
    path = tmp_path / "build.lock.json"
    path.write_text(lock.to_json())
    return lock, path


def test_info_summarizes_the_lock_and_json_is_raw(tmp_path):
    lock, path = _lock(tmp_path)
    env = entrypoint_env(FTIMAGE_LOCK=str(path))
    r = run_entrypoint(["info"], env=env)
    assert r.returncode == 0, r.stderr
    for text in ("qwen-test", "efefefefefefefef", "2.13.0+cu130", "13.0", "5.18.0", "sm_90", "causal-conv1d",
                 "key abababababab", "packages       0"):
        assert text in r.stdout
    r = run_entrypoint(["info", "--json"], env=env)
    assert json.loads(r.stdout) == json.loads(lock.to_json())


def test_info_without_lock_fails_with_fix():
    r = run_entrypoint(["info"])
    assert r.returncode == 1 and "no build lock" in r.stderr and "FTIMAGE_LOCK" in r.stderr


def test_lock_defaults_seed_the_config_below_yaml_and_overrides(tmp_path, monkeypatch):
    from entrypoint.launcher.preflight import lock_layer, resolve_config

    _, path = _lock(tmp_path)
    monkeypatch.setenv("FTIMAGE_LOCK", str(path))
    defaults, summary = lock_layer(lambda msg: None)
    assert summary["image"] == "qwen-test"
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("model: {path: m}\ndata: {path: d, max_length: 1024}\ntrain: {lr: 0.5}\n")
    cfg = resolve_config(str(yaml_path), ["train.max_steps=7", "output.profile_steps=5:8"], defaults)
    assert cfg.packing.budget == 4096          # from the lock
    assert cfg.train.lr == 0.5                 # YAML beats the lock
    assert cfg.train.max_steps == 7            # CLI beats both
    assert cfg.output.profile_steps == "5:8"   # stays text (YAML would read 5:8 as 308)


def test_config_errors_are_collected_with_fixes():
    with pytest.raises(ConfigError) as err:
        build_config([{"model": {"path": "m"}, "data": {"path": "d", "max_lenght": 5},
                       "train": {"max_steps": "many"}, "packing": {"mode": "zigzag"}, "bogus": {}}])
    text = str(err.value)
    assert "data.max_lenght: unknown field" in text and "did you mean `max_length`" in text
    assert "train.max_steps: expected an integer" in text
    assert "packing.mode: 'zigzag' is not one of: packed, padded" in text
    assert "bogus: unknown field" in text
    assert len(err.value.problems) == 4


def test_finetune_bad_config_is_a_message_not_a_traceback(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: m}\ndata: {path: d}\ntrain: {lr: -1, warmup: 3}\n")
    r = run_entrypoint(["finetune", "--config", str(cfg)])
    assert r.returncode == 2
    assert "train.warmup: unknown field" in r.stderr and "did you mean `warmup_steps`" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_entrypoint(["finetune", "--config", str(tmp_path / "missing.yaml")])
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_a_learning_rate_and_weight_decay_past_the_float_range_are_refused_before_any_rank(fixture_dir, tmp_path):
    """lr * weight_decay is AdamW's per-step decay: 1e308 * 1e308 is inf, which would surface steps
    later as a NaN loss (exit 1) instead of a config problem."""
    out = tmp_path / "out"
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), f"output.dir={out}", "train.lr=1e308",
                        "train.weight_decay=1e308"])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == ["error: invalid finetune config:"]
    assert "train.weight_decay: 1e+308 is out of range (allowed: a finite number >= 0.0 and <= 10.0)" in r.stderr
    assert "fix: set train.weight_decay in [0, 10]" in r.stderr and "Traceback" not in r.stderr
    assert "running verify" not in r.stderr and not out.exists()   # nothing ran, nothing was written
    with pytest.raises(ConfigError) as err:   # each in range, their product not: the product is named
        build_config([{"train": {"lr": 1e308, "weight_decay": 10.0}}], require_paths=False)
    [problem] = err.value.problems
    assert problem.field == "train.lr" and "= inf exceeds 1" in problem.problem
    assert "train.weight_decay" in problem.problem and "at most 1" in problem.fix
    cfg = build_config([{"train": {"lr": 0.1, "weight_decay": 10.0}}], require_paths=False)   # a product of 1
    assert (cfg.train.lr, cfg.train.weight_decay) == (0.1, 10.0)


def test_finetune_missing_data_names_the_fix(fixture_dir, tmp_path):
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "data.path=/nope.jsonl",
                        f"output.dir={tmp_path}"])
    assert r.returncode == 2 and "/nope.jsonl does not exist" in r.stderr and "data.path" in r.stderr


def _cfg(**launch) -> FinetuneConfig:
    cfg = FinetuneConfig()
    cfg.launch = replace(cfg.launch, **launch)
    cfg.model.path = "/nonexistent-model"
    return cfg


def test_more_ranks_than_visible_gpus_is_refused_with_the_fix(monkeypatch):
    from entrypoint.launcher import torchrun as launch

    monkeypatch.setattr(launch, "device_count", lambda: 1)
    with pytest.raises(LaunchError) as info:
        resolve_topology(_cfg(nproc_per_node=2), {})
    assert "launch.nproc_per_node=2 but only 1 GPUs are visible" in str(info.value)
    assert "expose more GPUs" in info.value.fix
    assert resolve_topology(_cfg(nproc_per_node=1), {}).nproc_per_node == 1


def test_topology_single_node_static_on_loopback():
    topo = resolve_topology(_cfg(nproc_per_node=2), {})
    args = topo.torchrun_args()
    assert topo.nnodes == 1 and args[args.index("--master-addr") + 1] == "127.0.0.1"
    assert args[args.index("--rdzv-backend") + 1] == "static" and topo.master_port > 0


def test_topology_multi_node_from_standard_env():
    env = {"NNODES": "4", "NODE_RANK": "2", "MASTER_ADDR": "head", "MASTER_PORT": "23456"}
    args = resolve_topology(_cfg(nproc_per_node=8), env).torchrun_args()
    assert args == ["--nnodes", "4", "--nproc-per-node", "8", "--rdzv-backend", "static", "--node-rank", "2",
                    "--master-addr", "head", "--master-port", "23456"]
    pet = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "1"}
    assert resolve_topology(_cfg(nproc_per_node=1), pet).node_rank == 1
    slurm = {"SLURM_NNODES": "3", "SLURM_NODEID": "0", "MASTER_ADDR": "n1"}
    assert resolve_topology(_cfg(nproc_per_node=1), slurm).master_port == 29500


def test_topology_c10d_and_missing_env():
    env = {"NNODES": "2", "RDZV_ENDPOINT": "head:29400", "RDZV_ID": "job7"}
    args = resolve_topology(_cfg(nproc_per_node=1), env).torchrun_args()
    assert args[-6:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "job7"]
    with pytest.raises(LaunchError, match="NODE_RANK"):
        resolve_topology(_cfg(nproc_per_node=1), {"NNODES": "2", "MASTER_ADDR": "x"})


def test_jit_caches_live_in_private_scratch_never_under_output_dir(tmp_path):
    """Triton loads the launcher .so files it finds in its cache: a cache on a shared output volume
    would run whatever another job put there."""
    import os
    import stat

    from entrypoint.launcher.torchrun import cache_env

    cfg = _cfg(nproc_per_node=1)
    cfg.output.dir = str(tmp_path / "out")
    (tmp_path / "home").mkdir()
    env = cache_env(cfg, {"HOME": str(tmp_path / "home")})
    private = tmp_path / "home" / ".cache" / "ftimage"
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "HF_HOME"):
        assert env[name].startswith(str(private)) and not env[name].startswith(cfg.output.dir), name
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700 and "HOME" not in env
    # `docker run -u 1234` gives HOME=/ or a path that does not exist: a private dir under TMPDIR
    (tmp_path / "tmp").mkdir()
    for home in ("/nonexistent-home", ""):
        env = cache_env(cfg, {"HOME": home, "TMPDIR": str(tmp_path / "tmp")})
        assert env["HOME"].startswith(str(tmp_path / "tmp" / f"ftimage-{os.getuid()}"))
        assert env["TRITON_CACHE_DIR"].startswith(str(tmp_path / "tmp" / f"ftimage-{os.getuid()}"))


def test_a_shared_scratch_folder_someone_else_can_write_is_never_used(tmp_path):
    import os

    from verify.scratch import NoScratch, private_dir, private_scratch

    planted = tmp_path / f"ftimage-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(NoScratch, match="not a private folder"):
        private_dir(planted)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(NoScratch):
        private_dir(tmp_path / "link")
    chosen = private_scratch({"HOME": "", "TMPDIR": str(tmp_path)})
    assert chosen != planted and not chosen.is_relative_to(tmp_path)   # the next candidate (/tmp, ...)


def test_verify_is_passed_through():
    r = run_entrypoint(["verify", "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: verify")


def test_packing_decision_under_the_gate():
    from entrypoint.launcher.preflight import decide_packing
    from entrypoint.launcher.verify_gate import GateOutcome

    ok = GateOutcome(passed=True, worst="PASS", table="")
    bad = GateOutcome(passed=False, worst="FAIL", table="")
    assert decide_packing("packed", ok).effective == "packed"
    assert decide_packing("padded", ok).effective == "padded"
    fallback = decide_packing("packed", bad)
    assert fallback.effective == "padded" and fallback.requested == "packed" and "leak" in fallback.reason
    assert decide_packing("padded", bad).effective == "padded"


def test_gate_reports_a_verify_crash_as_failure(monkeypatch):
    import sys

    from entrypoint.launcher import verify_gate as gate

    monkeypatch.setattr(gate, "verify_argv", lambda **_: [sys.executable, "-c", "raise SystemExit('kaboom')"])
    outcome = gate.run_verify()
    assert not outcome.passed and outcome.worst == "ERROR" and "exited 1 without a readable report" in outcome.table


def test_nodes_probing_one_shared_output_dir_do_not_trip_each_other(tmp_path):
    import threading

    from entrypoint.launcher.preflight import FinetuneError, check_writable

    out = tmp_path / "shared"
    errors: list[Exception] = []

    def node():
        for _ in range(200):
            try:
                check_writable(str(out))
            except FinetuneError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=node) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and list(out.iterdir()) == []    # no probe left behind
    (tmp_path / "file").write_text("")
    with pytest.raises(FinetuneError, match="not writable"):
        check_writable(str(tmp_path / "file" / "out"))


@pytest.mark.parametrize("command", [["finetune", "--config", "/nonexistent/finetune.yaml"],
                                     ["finetune", "export", "--checkpoint", "step-1", "--config", "/x.yaml"],
                                     ["inspect-data", "--config", "/nonexistent/finetune.yaml"]])
def test_a_root_with_no_writable_folder_is_a_clear_error_before_torch_is_imported(command, tmp_path, monkeypatch,
                                                                                   capsys):
    """`docker run --read-only --ipc none` (no /tmp, no /dev/shm): importing torch asks tempfile for a
    folder and raised FileNotFoundError with a traceback; now the command names the folders and the fix."""
    import tempfile

    from entrypoint.cli import main
    from verify import scratch

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(tmp_path / "read-only-tmp")])
    monkeypatch.setattr(scratch, "CANDIDATES", (str(tmp_path / "tmp"), str(tmp_path / "shm")))
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    assert main(command) == 2
    shown = capsys.readouterr().err
    assert f"error: no writable temporary directory (tried {tmp_path / 'tmp'}, {tmp_path / 'shm'})" in shown, shown
    assert "fix: mount a tmpfs at /tmp" in shown and "Traceback" not in shown
