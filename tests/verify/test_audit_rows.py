"""verify --no-lock (the audit of a foreign image) and the extensions rows: the SKIP rows that say
no lock was read, the decision functions with fake inputs (an undefined symbol, an ABI flag
mismatch, SASS that leaves out the GPU, a binding that caught an ImportError), and the stdlib
ELF reader against the build's pyelftools reader."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from families.binding import Resolution
from verify.checks import extensions as ext
from verify.checks.dispatch import decide_function
from verify.context import FusedNeed
from verify.elf_facts import cuda_runtime_major, cxx11_abi_of, read_facts
from verify.provenance import Verdict
from verify.report import Status
from verify.runner import ALL_CHECKS, CHECKS, UsageError, parse_checks, run_checks

pytestmark = pytest.mark.unit

ORIGIN = Verdict(True, "from fla-core 0.6.0: 3 module(s) loaded by the standard loaders, files matching its RECORD")
NEW_ABI = "_ZN3c106detail14torchCheckFailEPKcS2_jRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"
OLD_ABI = "_ZN3c106detail14torchCheckFailEPKcS2_jRKSs"


# -- --no-lock ------------------------------------------------------------------------------------

def test_no_lock_rows_are_skip_with_the_reason_and_nothing_compares_with_a_lock():
    report = run_checks("environment,model_fit", device="cpu", no_lock=True)
    rows = {r.check: r for r in report.results}
    assert rows["lock"].status is Status.SKIP and "no lock read (--no-lock)" in rows["lock"].detail
    assert "without an ftimage lock" in rows["lock"].detail
    for name in ("environment.versions", "environment.kernels", "model_fit"):
        assert rows[name].status is Status.SKIP and "no lock (--no-lock, an audit)" in rows[name].detail, name
    assert "torch" in rows["environment.versions"].data and "environment.lock" not in rows
    assert not any(r.startswith(("environment.python", "environment.package", "environment.kernel."))
                   for r in rows)
    # what needs no lock still fails closed
    assert rows["environment.cuda_device"].status is Status.FAIL


def test_without_a_lock_the_probes_run_at_the_given_model_head_dim(tmp_path):
    (tmp_path / "config.json").write_text('{"head_dim": 128, "hidden_size": 512, "num_attention_heads": 4}')
    rows = {r.check: r for r in run_checks("model_fit", device="cpu", no_lock=True, model=tmp_path).results}
    assert rows["model_fit"].status is Status.SKIP
    assert f"head dim 128 ({tmp_path}/config.json)" in rows["model_fit"].detail
    rows = {r.check: r for r in run_checks("model_fit", device="cpu", no_lock=True).results}
    assert "head dim 256" in rows["model_fit"].detail              # the family's own


def test_without_no_lock_a_missing_lock_still_fails():
    report = run_checks("model_fit", device="cpu", lock="/nonexistent/lock.json")
    assert {r.check: r for r in report.results}["lock"].status is Status.FAIL


def test_no_lock_and_a_lock_contradict():
    with pytest.raises(UsageError, match="contradict"):
        run_checks("environment", device="cpu", lock="/some/lock.json", no_lock=True)


def test_extensions_run_by_default_only_with_no_lock():
    assert "extensions" not in parse_checks(None) and parse_checks(None) == CHECKS
    assert parse_checks(None, no_lock=True) == ALL_CHECKS
    assert parse_checks("extensions,dispatch") == ("extensions", "dispatch")


def test_cli_no_lock_prints_skip_rows(run_verify, rows_by_check):
    code, out, err = run_verify("--no-lock", "--checks", "model_fit", "--json")
    assert code == 0, err
    rows = rows_by_check(out)
    assert rows["lock"]["status"] == "SKIP" and rows["model_fit"]["status"] == "SKIP"
    code, out, _ = run_verify("--no-lock", "--lock", "x.json", "--checks", "model_fit")
    assert code == 2 and "contradict" in out


def fused(module: str):
    def chunk_gated_delta_rule(q, k, v, cu_seqlens=None):
        return q
    chunk_gated_delta_rule.__module__ = module
    return chunk_gated_delta_rule


def test_a_fused_kernel_no_lock_lists_passes_in_an_audit_and_fails_against_a_lock():
    need = FusedNeed("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule", "cu_seqlens", None)
    res = Resolution("torch_chunk_gated_delta_rule", implementation=fused("fla.ops.gated_delta_rule"),
                     is_new=True, applicable_params=("q", "k", "v", "cu_seqlens"), package="fla")
    runtime = {"torch": 0, "fused": 2}
    audit = decide_function(need, res, runtime, "", "", audit=True, provenance=ORIGIN)
    assert audit.status is Status.PASS and "no lock (--no-lock, an audit)" in audit.detail
    assert decide_function(need, res, runtime, "", "", provenance=ORIGIN).status is Status.FAIL


def test_a_fallback_in_an_audit_names_the_package_to_install():
    need = FusedNeed("causal_conv1d_fn", "causal_conv1d_fn", "seq_idx", None)
    res = Resolution("causal_conv1d_fn", implementation=fused("transformers.x"), is_new=False, package="causal_conv1d")
    row = decide_function(need, res, None, "", "`causal_conv1d` is not installed", audit=True, provenance=ORIGIN)
    assert row.status is Status.FAIL and "torch reference path" in row.detail
    assert "install `causal_conv1d` built for this image's torch and CUDA" in row.fix


# -- the extensions rows, from fake inputs --------------------------------------------------------

def test_an_extension_whose_import_raises_undefined_symbol_fails_with_the_real_error():
    error = f"ImportError: /site/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: {OLD_ABI}"
    row = ext.decide_import("flash_attn", "flash_attn", "2.8.3", True, "", {"flash_attn_2_cuda": error},
                            provenance=ORIGIN)
    assert row.status is Status.FAIL and f"undefined symbol: {OLD_ABI}" in row.detail
    assert "`import flash_attn_2_cuda` raises" in row.detail and "ABI mismatch" in row.fix


def test_a_package_that_imports_passes_and_an_absent_one_is_skip():
    ok = ext.decide_import("causal_conv1d", "causal_conv1d", "1.7.0", True, "", {"causal_conv1d_cuda": ""},
                           provenance=ORIGIN)
    assert ok.status is Status.PASS and "causal_conv1d_cuda import" in ok.detail
    hooked = Verdict(False, "`causal_conv1d` was served by an import hook: loader evil.Loader (defined in /s/evil.py)",
                     "remove /s/evil.py from the image")
    served = ext.decide_import("causal_conv1d", None, None, True, "", {}, provenance=hooked)
    assert served.status is Status.FAIL and "/s/evil.py" in served.detail and "/s/evil.py" in served.fix
    assert ext.decide_import("fla", None, None, False, "", {}, provenance=ORIGIN).status is Status.SKIP


def facts(**kw):
    base = {"torch_version": "2.13.0+cu130", "torch_cuda": "13.0", "torch_abi": True,
            "extensions": ("flash_attn_2_cuda",)}
    return ext.AbiFacts(**{**base, **kw})


def test_an_abi_flag_mismatch_fails_naming_both_sides():
    row = ext.decide_abi("flash_attn", facts(built_for=ext.parse_built_for("2.8.3+cu13torch2.13cxx11abiFALSE")))
    assert row.status is Status.FAIL
    assert "_GLIBCXX_USE_CXX11_ABI=0 (local version tag +cu13torch2.13cxx11abiFALSE)" in row.detail
    assert "torch._C._GLIBCXX_USE_CXX11_ABI=1" in row.detail and "rebuild flash_attn from source" in row.fix


def test_the_abi_read_from_the_torch_symbols_when_no_tag_says():
    row = ext.decide_abi("flash_attn", facts(symbol_abi=cxx11_abi_of((OLD_ABI,))))
    assert row.status is Status.FAIL and "(the torch symbols it links)" in row.detail
    assert ext.decide_abi("flash_attn", facts(symbol_abi=cxx11_abi_of((NEW_ABI,)))).status is Status.PASS


def test_a_wheel_for_another_torch_or_cuda_fails():
    other_torch = ext.decide_abi("x", facts(built_for=ext.parse_built_for("1.0+cu13torch2.7cxx11abiTRUE")))
    assert other_torch.status is Status.FAIL and "built for torch 2.7" in other_torch.detail
    other_cuda = ext.decide_abi("x", facts(cudart_major=12))
    assert other_cuda.status is Status.FAIL and "built for CUDA 12 (links libcudart.so.12)" in other_cuda.detail
    cpu = ext.decide_abi("x", facts(torch_cuda=None, torch_version="2.13.0+cpu", cudart_major=13))
    assert cpu.status is Status.FAIL and "the image's torch is a CPU build" in cpu.detail


def test_abi_rows_that_cannot_judge_are_skip():
    assert ext.decide_abi("x", facts()).status is Status.SKIP                      # nothing stated
    assert ext.decide_abi("fla", facts(extensions=())).status is Status.SKIP       # pure Python / Triton


def test_built_for_is_read_from_the_version_or_the_wheel_name():
    tag = ext.parse_built_for("2.8.3", "flash_attn-2.8.3+cu12torch2.7cxx11abiTRUE-cp311-cp311-linux_x86_64.whl")
    assert (tag.torch, tag.cuda_major, tag.cxx11_abi) == ("2.7", 12, True) and "wheel file name" in tag.source
    assert ext.parse_built_for("2.14.1+cu130").cuda_major == 13
    assert ext.parse_built_for("2.8.3").source == "" and ext.parse_built_for("1.0+cu118").cuda_major == 11


def test_sass_that_leaves_out_the_gpu_fails_and_ptx_warns():
    missing = ext.decide_sass("flash_attn", (80,), (), (9, 0))
    assert missing.status is Status.FAIL and "nothing runs on this sm_90" in missing.detail
    assert "TORCH_CUDA_ARCH_LIST" in missing.fix
    jit = ext.decide_sass("flash_attn", (80,), (80,), (9, 0))
    assert jit.status is Status.WARN and "JIT-compiles compute_80 PTX" in jit.detail
    assert ext.decide_sass("x", (90,), (), (9, 0)).status is Status.PASS
    assert ext.decide_sass("x", (80,), (), (8, 6)).status is Status.PASS           # same major, lower minor
    assert ext.decide_sass("x", (86,), (), (8, 0)).status is Status.FAIL
    assert ext.decide_sass("x", (90,), (), None).status is Status.SKIP             # no GPU to compare
    assert ext.decide_sass("fla", (), (), (9, 0), has_extension=False).status is Status.SKIP


def test_a_binding_that_caught_an_import_error_fails_with_that_error():
    res = Resolution("torch_chunk_gated_delta_rule", implementation=fused("transformers.models.qwen3_5"),
                     is_new=False, package="fla")
    why = "fla-core 0.6.0 is installed but `import fla` raises ImportError: libtriton.so: undefined symbol: _Zfoo"
    row = ext.decide_binding("torch_chunk_gated_delta_rule", res, True, why, provenance=ORIGIN)
    assert row.status is Status.FAIL and "caught an import error" in row.detail and why in row.detail
    assert row.data["error"] == why
    assert ext.decide_binding("torch_chunk_gated_delta_rule", res, False, "", provenance=ORIGIN).status is Status.SKIP
    bound = Resolution("x", implementation=fused("fla.ops"), is_new=True, package="fla")
    assert ext.decide_binding("x", bound, True, "", provenance=ORIGIN).status is Status.PASS
    assert ext.decide_binding("x", bound, True, "", provenance=None).status is Status.FAIL   # never read: fail closed


def test_a_real_extension_with_an_undefined_torch_symbol(tmp_path, monkeypatch):
    """A compiled extension expecting an old-ABI c10 symbol, found through its RECORD: the import
    row shows the loader's real "undefined symbol" error, the ABI row reads the old ABI."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to compile the test extension")
    site = tmp_path / "site"
    pkg = site / "abitest_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    suffix = next(s for s in __import__("importlib.machinery").machinery.EXTENSION_SUFFIXES if "cpython" in s)
    so = site / f"abitest_cuda{suffix}"
    src = tmp_path / "ext.c"
    src.write_text(f"extern void {OLD_ABI}(void);\nvoid call(void) {{ {OLD_ABI}(); }}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    info = site / "abitest_pkg-1.0+cu13torch2.13.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: abitest_pkg\nVersion: 1.0+cu13torch2.13\n")
    (info / "top_level.txt").write_text("abitest_pkg\nabitest_cuda\n")
    (info / "RECORD").write_text(f"abitest_pkg/__init__.py,,\nabitest_cuda{suffix},,\n{info.name}/RECORD,,\n")
    monkeypatch.syspath_prepend(str(site))
    installed = ext.locate("abitest_pkg")
    assert installed.distribution == "abitest_pkg" and set(installed.extensions) == {"abitest_cuda"}
    rows = {r.check: r for r in ext.package_rows(installed, (9, 0))}
    imp = rows["extensions.abitest_pkg"]
    assert imp.status is Status.FAIL and f"undefined symbol: {OLD_ABI}" in imp.detail
    assert rows["extensions.abitest_pkg.abi"].status is Status.FAIL
    assert rows["extensions.abitest_pkg.sass"].status is Status.SKIP       # no device code at all
    sys.modules.pop("abitest_pkg", None)


# -- the ELF reader -------------------------------------------------------------------------------

def fatbin(entries: list[tuple[int, int]]) -> bytes:
    """One fatbin: header then (kind, sm) entries with an 8-byte payload each."""
    body = b""
    for kind, sm in entries:
        header = struct.pack("<HHIQ", kind, 0, 64, 8) + b"\0" * 12 + struct.pack("<I", sm) + b"\0" * 32
        body += header + b"\xaa" * 8
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def make_elf(fatbin_blob: bytes, needed: tuple[str, ...], undefined: tuple[str, ...]) -> bytes:
    """A minimal ELF64 LE shared object: .shstrtab, .nv_fatbin, .dynstr, .dynsym, .dynamic."""
    dynstr = b"\0"
    offsets = {}
    for name in needed + undefined:
        offsets[name] = len(dynstr)
        dynstr += name.encode() + b"\0"
    dynsym = b"\0" * 24 + b"".join(struct.pack("<IBBHQQ", offsets[n], 0x12, 0, 0, 0, 0) for n in undefined)
    dynamic = b"".join(struct.pack("<qQ", 1, offsets[n]) for n in needed) + struct.pack("<qQ", 0, 0)
    names = [b"", b".shstrtab", b".nv_fatbin", b".dynstr", b".dynsym", b".dynamic"]
    shstrtab = b"\0".join(names) + b"\0"
    name_off = [shstrtab.index(n + b"\0") if n else 0 for n in names]
    blobs = [b"", shstrtab, fatbin_blob, dynstr, dynsym, dynamic]
    types = [0, 3, 1, 3, 11, 6]
    links = [0, 0, 0, 0, 3, 3]
    entsize = [0, 0, 0, 0, 24, 16]
    data, pos, placed = b"", 64, []
    for blob in blobs:
        placed.append(pos + len(data))
        data += blob + b"\0" * (-len(blob) % 8)
    shoff = 64 + len(data)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\0" * 8
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(blobs), 1)
    sections = b"".join(struct.pack("<IIQQQQIIQQ", name_off[i], types[i], 0, 0, placed[i] if i else 0,
                                    len(blobs[i]), links[i], 1 if types[i] == 11 else 0, 8, entsize[i])
                        for i in range(len(blobs)))
    return header + data + sections


def test_the_elf_reader_finds_archs_needed_libs_and_undefined_symbols(tmp_path):
    blob = fatbin([(2, 80), (2, 90), (1, 90)]) + b"\0" * 8 + fatbin([(2, 100)])
    path = tmp_path / "x.so"
    path.write_bytes(make_elf(blob, ("libc10.so", "libcudart.so.12"), (NEW_ABI, "memcpy")))
    f = read_facts(path)
    assert f.sass == (80, 90, 100) and f.ptx == (90,)
    assert f.needed == ("libc10.so", "libcudart.so.12") and cuda_runtime_major(f.needed) == 12
    assert set(f.undefined) == {NEW_ABI, "memcpy"} and cxx11_abi_of(f.undefined) is True


def test_the_elf_reader_agrees_with_the_build_pyelftools_reader(tmp_path):
    pytest.importorskip("elftools")
    from build.kernels.archs import archs_of_shared_object

    data = make_elf(fatbin([(2, 75), (2, 86), (1, 86)]), (), ())
    (tmp_path / "y.so").write_bytes(data)
    f = read_facts(tmp_path / "y.so")
    assert archs_of_shared_object(data) == (set(f.sass), set(f.ptx))


def test_the_elf_reader_agrees_on_the_cached_kernel_wheels(tmp_path):
    """The real kernel wheels the build compiled, where this machine's cache holds them."""
    pytest.importorskip("elftools")
    import zipfile

    from build.kernels.archs import archs_of_wheel

    # not default_cache_root(): verify's scratch (run by earlier tests) moves XDG_CACHE_HOME
    root = Path(os.environ.get("FTIMAGE_CACHE") or Path.home() / ".cache" / "ftimage")
    wheels = sorted((root / "kernels").glob("*/*.whl"))[:3]
    if not wheels:
        pytest.skip("no compiled kernel wheel in the cache")
    for wheel in wheels:
        report = archs_of_wheel(wheel)
        sass, ptx = set(), set()
        with zipfile.ZipFile(wheel) as zf:
            for name in report.shared_objects:
                out = tmp_path / Path(name).name
                out.write_bytes(zf.read(name))
                f = read_facts(out)
                sass |= set(f.sass)
                ptx |= set(f.ptx)
        assert tuple(f"sm_{n}" for n in sorted(sass)) == report.sass and \
            tuple(f"sm_{n}" for n in sorted(ptx)) == report.ptx, wheel.name


def test_cxx11_abi_reading():
    assert cxx11_abi_of((NEW_ABI,)) is True and cxx11_abi_of((OLD_ABI,)) is False
    assert cxx11_abi_of(("memcpy", "_ZNSt6thread6_StateD2Ev")) is None   # no torch symbol: cannot tell
