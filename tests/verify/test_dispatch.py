import sys
import types

import pytest

from families import load_family
from tests.fixtures.locks import manifest_kernel
from verify.checks import dispatch
from verify.context import Context, FusedNeed
from verify.provenance import Verdict
from verify.report import Status

pytestmark = pytest.mark.unit
FAMILY = load_family("qwen3_5_text")
CONV_FN = next(f for f in FAMILY.fused_functions if f.function == "causal_conv1d_fn")
LOCKED_CONV = manifest_kernel("causal-conv1d")
CONV = FusedNeed(CONV_FN.function, CONV_FN.wrapper, CONV_FN.boundary_kwarg, LOCKED_CONV)
UNLOCKED_CONV = FusedNeed(CONV_FN.function, CONV_FN.wrapper, CONV_FN.boundary_kwarg, None)
# where the implementation came from (verify.provenance): these tests are about the other conditions
ORIGIN = Verdict(True, "from causal-conv1d 1.7.0: 2 module(s) loaded by the standard loaders, files matching its "
                 "RECORD")
HOOKED = Verdict(False, "`causal_conv1d` was served by an import hook, not loaded from an installed distribution: "
                 "loader evil.Loader (defined in /site/evil.py), installed by /site/evil.pth",
                 "remove /site/evil.py, /site/evil.pth from the image and install the kernel from its wheel")


@pytest.fixture
def fused_resolution(monkeypatch):
    """A Resolution read from transformers' REAL wrapper, around a fake installed `causal_conv1d`."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    pkg = types.ModuleType("causal_conv1d")

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
        return x
    causal_conv1d_fn.__module__ = "causal_conv1d.causal_conv1d_interface"
    pkg.causal_conv1d_fn = causal_conv1d_fn
    monkeypatch.setitem(sys.modules, "causal_conv1d", pkg)

    @use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
    def wrapped(hidden_states, weight, bias=None, activation=None, **kwargs):
        return hidden_states

    module = types.SimpleNamespace(__name__="fake_modeling", causal_conv1d_fn=wrapped)
    return dispatch.read_resolution(module, "causal_conv1d_fn")


def test_reads_the_real_resolution_on_this_machine():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    res = dispatch.read_resolution(m, "causal_conv1d_fn")
    assert res.readable and res.is_new is False
    assert res.implementation is res.torch_function
    assert "seq_idx" not in res.applicable_params  # the torch fallback would drop it


def test_unreadable_wrapper_fails_with_a_fix():
    module = types.SimpleNamespace(__name__="m", causal_conv1d_fn=lambda x: x)
    res = dispatch.read_resolution(module, "causal_conv1d_fn")
    row = dispatch.decide_function(CONV, res, None, "", "", provenance=ORIGIN)
    assert row.status is Status.FAIL and "cannot read transformers' resolution" in row.detail


def test_fused_resolution_passes_only_when_the_layer_really_called_it(fused_resolution):
    assert fused_resolution.is_new and "seq_idx" in fused_resolution.applicable_params
    ok = dispatch.decide_function(CONV, fused_resolution, {"fused": 2, "torch": 0}, "", "", provenance=ORIGIN)
    assert ok.status is Status.PASS, ok.detail
    hooked = dispatch.decide_function(CONV, fused_resolution, {"fused": 2, "torch": 0}, "", "", provenance=HOOKED)
    assert hooked.status is Status.FAIL and "/site/evil.py" in hooked.detail and "/site/evil.pth" in hooked.fix
    unread = dispatch.decide_function(CONV, fused_resolution, {"fused": 2, "torch": 0}, "", "", provenance=None)
    assert unread.status is Status.FAIL and "was not read" in unread.detail
    swapped = dispatch.decide_function(CONV, fused_resolution, {"fused": 0, "torch": 2}, "", "", provenance=ORIGIN)
    assert swapped.status is Status.FAIL and "called the torch reference 2x" in swapped.detail
    not_run = dispatch.decide_function(CONV, fused_resolution, None, "RuntimeError: no GPU", "", provenance=ORIGIN)
    assert not_run.status is Status.FAIL and "no GPU" in not_run.detail
    unlocked = dispatch.decide_function(UNLOCKED_CONV, fused_resolution, {"fused": 2, "torch": 0}, "", "",
                                        provenance=ORIGIN)
    assert unlocked.status is Status.FAIL and "the lock has no kernel" in unlocked.detail


def test_kernel_without_the_boundary_kwarg_fails(fused_resolution):
    from dataclasses import replace

    res = replace(fused_resolution, applicable_params=("x", "weight", "bias", "activation"))
    row = dispatch.decide_function(CONV, res, {"fused": 2, "torch": 0}, "", "", provenance=ORIGIN)
    assert row.status is Status.FAIL and "takes no `seq_idx`" in row.detail


def test_explain_fallback_reports_the_real_import_error(tmp_path, monkeypatch):
    pkg = tmp_path / "ftimage_broken_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = dispatch.explain_fallback("ftimage_broken_kernel", "ftimage_broken_kernel.fn", "ftimage-broken-kernel")
    assert "raises OSError: libcuda.so.1: cannot open shared object file" in why
    assert "not installed" not in why
    missing = dispatch.explain_fallback("ftimage_absent_kernel", "ftimage_absent_kernel.fn", "ftimage-absent")
    assert "is not installed" in missing and "ModuleNotFoundError" in missing


def test_attention_decisions():
    attn = FAMILY.attention
    sdpa = dispatch.decide_attention(attn, "sdpa", "", "sdpa", None, {"torch": 2, "fused": 0}, "", provenance=ORIGIN)
    assert sdpa.status is Status.FAIL
    refused = dispatch.decide_attention(attn, "flash_attention_2", "FlashAttention2 ... not installed", None, None,
                                        None, "`flash_attn` is present at /x but `import flash_attn` raises ...",
                                        provenance=ORIGIN)
    assert refused.status is Status.FAIL and "raises" in refused.detail

    def flash_attn_varlen_func(q, k, v):
        return q
    flash_attn_varlen_func.__module__ = "flash_attn.flash_attn_interface"
    ok = dispatch.decide_attention(attn, "flash_attention_2", "", "flash_attention_2", flash_attn_varlen_func,
                                   {"torch": 0, "fused": 2}, "", provenance=ORIGIN)
    assert ok.status is Status.PASS
    for origin in (HOOKED, None):   # the same flash_attn, served by an import hook or never read: not the kernel
        row = dispatch.decide_attention(attn, "flash_attention_2", "", "flash_attention_2", flash_attn_varlen_func,
                                        {"torch": 0, "fused": 2}, "", provenance=origin)
        assert row.status is Status.FAIL and ("/site/evil.pth" in row.detail if origin else "not read" in row.detail)
    unlocked = dispatch.decide_attention(attn, "flash_attention_2", "", "flash_attention_2", flash_attn_varlen_func,
                                         {"torch": 0, "fused": 2}, "", locked=False, provenance=ORIGIN)
    assert unlocked.status is Status.FAIL and "the lock has no kernel" in unlocked.detail
    flash_attn_varlen_func.__module__ = "kernels_community.flash_attn2"
    hub = dispatch.decide_attention(attn, "flash_attention_2", "", "flash_attention_2", flash_attn_varlen_func,
                                    {"torch": 0, "fused": 2}, "", provenance=ORIGIN)
    assert hub.status is Status.FAIL and "Kernel Hub" in hub.detail


def test_kernel_hub_decisions():
    assert dispatch.decide_kernel_hub(None, True, False).status is Status.PASS
    assert dispatch.decide_kernel_hub("0.17.2", False, False).status is Status.PASS
    assert dispatch.decide_kernel_hub("0.17.2", True, False).status is Status.WARN
    assert dispatch.decide_kernel_hub("0.17.2", True, True).status is Status.FAIL


def test_dispatch_on_cpu_detects_the_fallback_at_run_time(env_lock):
    ctx = Context(lock=env_lock, device="cpu", family=FAMILY)
    rows = {r.check: r for r in dispatch.run(ctx)}
    for name in ("causal_conv1d_fn", "chunk_gated_delta_rule"):
        row = rows[f"dispatch.{name}"]
        assert row.status is Status.FAIL and row.detail.startswith("torch reference path")
        # the layer instance really ran the torch function (2 GDN layers in the probe model)
        assert row.data["runtime_calls"] == {"torch": 2, "fused": 0}
    assert rows["dispatch.attention"].status is Status.FAIL


@pytest.mark.slow
def test_broken_installed_package_is_named_not_called_missing(tmp_path, cpu_lock_path, run_verify, rows_by_check):
    """transformers resolves at import, so the stub must be on PYTHONPATH of a fresh interpreter."""
    stub = tmp_path / "stub" / "fla"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "raise ImportError('fla/ops/_C.so: undefined symbol: _ZN3c104cuda20CUDACachingAllocator9allocatorE')\n")
    code, out, err = run_verify("--device", "cpu", "--checks", "dispatch", "--json", "--lock", str(cpu_lock_path),
                                extra_pythonpath=tmp_path / "stub", env={"TRANSFORMERS_VERBOSITY": "warning"})
    assert code == 2, err
    row = rows_by_check(out)["dispatch.chunk_gated_delta_rule"]
    assert row["status"] == "FAIL"
    assert "raises ImportError: fla/ops/_C.so: undefined symbol" in row["detail"]
    assert "not installed" not in row["detail"]
    assert "ABI" in row["fix"]
    # ... while transformers' own warning claims it is not installed
    assert "`flash-linear-attention` is not installed" in err


def test_dispatch_asked_for_cuda_without_one_still_reads_the_resolution(env_lock):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rows = {r.check: r for r in dispatch.run(Context(lock=env_lock, device="cuda", family=FAMILY))}
    assert rows["dispatch.causal_conv1d_fn"].detail.startswith("torch reference path")
    assert rows["dispatch.attention"].status is Status.FAIL
    assert all(r.status is not Status.PASS for n, r in rows.items() if n != "dispatch.kernel_hub")
