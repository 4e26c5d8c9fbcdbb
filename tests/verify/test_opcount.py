import importlib
import json
import subprocess
import sys

import pytest

from verify import opcount


@pytest.mark.unit
def test_fallback_hiding_makes_an_installed_package_fail_to_import(tmp_path, monkeypatch):
    (tmp_path / "causal_conv1d").mkdir()
    (tmp_path / "causal_conv1d" / "__init__.py").write_text("def causal_conv1d_fn(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)
    hide = opcount._Hide()
    assert hide.find_spec("causal_conv1d") is not None
    assert hide.find_spec("fla") is None            # not installed here: nothing to hide
    assert hide.find_spec("torch") is None          # not ours to hide
    monkeypatch.setattr(sys, "meta_path", [hide, *sys.meta_path])
    with pytest.raises(ImportError, match="hidden by verify.opcount --fallback"):
        importlib.import_module("causal_conv1d")


@pytest.mark.training  # a fresh interpreter and a profiled step: ~10-20 s on 2 cores
def test_opcount_dry_run_on_cpu_counts_the_torch_reference_calls(repo):
    proc = subprocess.run([sys.executable, "-m", "verify.opcount", "--device", "cpu", "--steps", "1", "--warmup", "0",
                           "--json"],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["kernel_launches_per_step"] == 0
    assert result["ops"]["causal_conv1d_fn"] == {"resolved": "torch", "fused_forward_launches": 0,
                                                 "fused_backward_launches": 0, "torch_reference_calls": 2}
    assert result["ops"]["chunk_gated_delta_rule"]["torch_reference_calls"] == 2


@pytest.mark.unit
def test_opcount_refuses_cuda_without_a_device():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert opcount.main(["--steps", "1"]) == 2
