"""bench/cpu_by_process.py: the kinds it charges, and a ledger that charges only the command's
CPU (not what a process used before it began, not a reused PID's predecessor)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.cpu_by_process import OTHER, OTHER_PYTHON, Ledger, kind_of, main, read_processes
from entrypoint.launcher.verify_gate import verify_argv

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cmdline, name, kind", [
    ("/usr/bin/python3 -u -m entrypoint.train --plan /out/.launch/plan-node0.json", "python3", "training rank"),
    ("/usr/bin/python3 -m entrypoint.launcher.agent /out --nnodes 1 --nproc-per-node 2", "pt_elastic",
     "torchrun agent"),
    (" ".join(verify_argv(model="/fx/model", param_dtype="float32")), "python3", "verify (gate, CLI, in containers)"),
    ("/opt/ftimage/venv/bin/python -m verify --json", "python", "verify (gate, CLI, in containers)"),
    ("/usr/bin/python3 -m entrypoint finetune --config /fx/config.yaml", "python3",
     "launcher (finetune, preflight, tokenising)"),
    ("/usr/local/cuda/nvvm/bin/cicc --c++17 -arch compute_90 flash_bwd_hdim256_bf16_sm80.cu", "cicc",
     "kernel compile (nvcc, cicc, ptxas, cc1plus, ld)"),
    ("/usr/bin/python3 -m build images/smoke --json", "python3", "image build CLI (resolve, assemble, gzip, push)"),
    ("/usr/sbin/dockerd", "dockerd", "engine (dockerd, containerd, layer untar)"),
    ("/proc/self/exe --root /var/lib/docker/overlay2", "exe", "engine (dockerd, containerd, layer untar)"),
    ("", "kworker/1:1H-kblockd", OTHER),
    ("/usr/bin/python3 bench/tokenizing.py", "python3", OTHER_PYTHON),
])
def test_every_kind_of_process_the_suite_starts_is_named(cmdline, name, kind):
    assert kind_of(cmdline, name) == kind


def test_the_ledger_charges_only_cpu_used_after_it_began():
    ledger = Ledger(hz=100)
    rank = "/usr/bin/python3 -u -m entrypoint.train --plan p"
    ledger.observe([(10, "500", "python3", rank, 1000)])            # 10 s before the command: not charged
    ledger.observe([(10, "500", "python3", rank, 1250),
                    (11, "900", "cicc", "cicc --c++17 x.cu", 300)])   # born since the last look: all of it
    ledger.observe([(11, "900", "cicc", "cicc --c++17 x.cu", 300),    # no new CPU: nothing more
                    (10, "950", "python3", "/usr/bin/python3 -m pip install x", 40)])   # PID 10 reused
    assert ledger.seconds() == {"kernel compile (nvcc, cicc, ptxas, cc1plus, ld)": 3.0, "training rank": 2.5,
                                "pip": 0.4}


def test_proc_is_read_as_the_kernel_writes_it(tmp_path):
    process = tmp_path / "4242"
    process.mkdir()
    # a name with a space and a parenthesis, as a thread may call itself
    fields = ["S"] + ["0"] * 10 + ["150", "25"] + ["0"] * 6 + ["777"] + ["0"] * 30
    (process / "stat").write_text(f"4242 (odd (name) x) {' '.join(fields)}\n")
    (process / "cmdline").write_bytes(b"/usr/bin/python3\0-m\0entrypoint.train\0")
    (tmp_path / "self").mkdir()                                          # not a PID: skipped
    assert read_processes(tmp_path) == [(4242, "777", "odd (name) x", "/usr/bin/python3 -m entrypoint.train", 175)]


def test_a_command_is_run_timed_and_charged_with_its_exit_code(tmp_path, capsys):
    out = tmp_path / "figures.json"
    burn = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\nraise SystemExit(3)"
    assert main(["--every", "0.1", "--json", str(out), "--", sys.executable, "-c", burn]) == 3
    figures = json.loads(out.read_text())
    assert figures["exit"] == 3 and figures["busy_cpu_s"] > 0
    assert figures["by_kind_cpu_s"].get(OTHER_PYTHON, 0) >= 0.3      # the child's burn, seen by the samples
    assert "machine busy (/proc/stat)" in capsys.readouterr().out


def test_a_command_that_cannot_start_is_one_line_not_a_traceback(capsys):
    assert main(["--", str(Path("/nonexistent/tool"))]) == 2
    assert "cannot run '/nonexistent/tool'" in capsys.readouterr().err
