"""Where a kernel came from (verify.provenance over verify.import_facts): a fused function counts
only when its modules were loaded by the standard file loaders from files an installed
distribution's RECORD lists with their sha256, its code is theirs, a cuda-extension's compiled
module came from the same distribution, and no import hook served it.

The decisions are driven with Hypothesis over structured facts; the facts are read for real from
temporary site folders in this process; and three fresh interpreters (a venv each, since a .pth
runs only at start) show the table: a .pth whose finder serves fake `causal_conv1d` and `fla`, the
test doubles installed as real distributions beside this project's own hooks, and a .pth that
patches an installed kernel and plants modules of its own."""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib
import importlib.machinery
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verify.import_facts import Survey
from verify.provenance import (
    MANIFEST_KINDS,
    OWN_PTH,
    OWN_WATCHER,
    STANDARD,
    Hook,
    KernelFacts,
    ModuleFacts,
    judge_kernel,
    judge_module,
    kind_of,
)

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
DOUBLES = REPO / "tests" / "guard" / "kernels" / "fused"
AUDIT = ("--no-lock", "--device", "cpu", "--checks", "environment,extensions,dispatch,isolation", "--json")
ISOLATION = [f"isolation.{k}" for k in ("attention", "gdn", "conv", "logits", "grads")]
BINDINGS = [f"extensions.binding.{w}" for w in ("causal_conv1d_fn", "causal_conv1d_update",
                                                 "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")]


# -- the decisions, over structured facts -----------------------------------------------------------

FOREIGN = Hook("meta_path", "evil.Finder", "/site/evil.py", False, ("/site/evil.pth",))
OWN = Hook("meta_path", "guard.boot.ModelingWatcher", "/app/guard/boot.py", True)
PTH = Hook("pth", "other.pth", "/site/other.pth")
any_module = st.builds(
    ModuleFacts, name=st.sampled_from(["k", "k.ops", "k_cuda"]),
    loader=st.sampled_from(["source", "sourceless", "extension", "namespace", "other", "none"]),
    origin=st.sampled_from(["", "/site/k/ops.py", "/tmp/k/ops.py"]), served_by=st.sampled_from([None, OWN, FOREIGN]),
    distribution=st.sampled_from(["", "k 1.0", "other 2.0"]), hash_ok=st.sampled_from([True, False, None]),
    hooks=st.lists(st.sampled_from([OWN, FOREIGN, PTH]), max_size=3, unique=True).map(tuple))
good_module = st.builds(
    ModuleFacts, name=st.sampled_from(["k", "k.ops"]), loader=st.sampled_from(sorted(STANDARD)),
    origin=st.just("/site/k/ops.py"), served_by=st.sampled_from([None, OWN]), distribution=st.just("k 1.0"),
    hash_ok=st.just(True), hooks=st.lists(st.sampled_from([OWN, FOREIGN, PTH]), max_size=3, unique=True).map(tuple))
# a good module with exactly one condition of the rule broken
near_miss = good_module.flatmap(lambda m: st.sampled_from([
    dataclasses.replace(m, loader="other"), dataclasses.replace(m, loader="none"),
    dataclasses.replace(m, served_by=FOREIGN), dataclasses.replace(m, origin=""),
    dataclasses.replace(m, distribution=""), dataclasses.replace(m, hash_ok=False),
    dataclasses.replace(m, hash_ok=None)]))
modules = st.one_of(good_module, near_miss, any_module)
good_extension = st.builds(ModuleFacts, name=st.just("k_cuda"), loader=st.just("extension"),
                           origin=st.just("/site/k_cuda.so"), distribution=st.just("k 1.0"), hash_ok=st.just(True))
kernels = st.builds(
    KernelFacts, what=st.just("k.ops.fn"), kind=st.sampled_from(["cuda-extension", "triton", ""]),
    modules=st.lists(st.one_of(good_module, good_module, near_miss, any_module), max_size=3).map(tuple),
    code=st.lists(st.tuples(st.sampled_from(["/site/k/ops.py", "/site/evil.py"]),
                            st.sampled_from(["k 1.0", "k 1.0", "torch 2.13", ""])), max_size=2).map(tuple),
    extension=st.sampled_from(["k_cuda", "k_cuda", ""]),
    extension_facts=st.one_of(st.none(), good_extension, good_extension, modules))


def module_passes(m: ModuleFacts) -> bool:
    return (m.loader in STANDARD and (m.served_by is None or m.served_by.allowed) and bool(m.origin)
            and bool(m.distribution) and m.hash_ok is True)


def kernel_passes(k: KernelFacts) -> bool:
    if not k.modules or not all(module_passes(m) for m in k.modules):
        return False
    home = k.modules[0].distribution
    if any(not vouched for _, vouched in k.code) or (k.code and k.code[-1][1] != home):
        return False
    if k.kind != "cuda-extension":
        return True
    e = k.extension_facts
    return bool(k.extension) and e is not None and module_passes(e) and e.loader == "extension" and \
        e.distribution == home


@settings(max_examples=200, deadline=None)
@given(modules)
def test_a_module_counts_only_when_every_condition_of_the_rule_holds(m):
    verdict = judge_module(m)
    assert verdict.ok is module_passes(m), (m, verdict)
    # hooks that did not serve it (they only watch) never change the verdict
    assert judge_module(dataclasses.replace(m, hooks=())).ok is verdict.ok
    if verdict.ok:
        assert m.distribution in verdict.detail
        return
    assert verdict.fix
    said = verdict.detail + verdict.fix
    if m.served_by is not None and not m.served_by.allowed:
        assert all(f in said for f in m.served_by.files())          # the finder's file and its .pth
    elif m.loader not in STANDARD:
        assert all(f in said for h in m.hooks if not h.allowed for f in h.files())
    elif m.origin:
        assert m.origin in verdict.detail                           # the unlisted or changed file


@settings(max_examples=200, deadline=None)
@given(kernels)
def test_a_fused_function_counts_only_when_every_module_its_code_and_its_extension_do(k):
    verdict = judge_kernel(k)
    assert verdict.ok is kernel_passes(k), (k, verdict)
    if verdict.ok:
        assert k.modules[0].distribution in verdict.detail and verdict.data["ok"]
        return
    assert verdict.detail and verdict.fix
    if k.modules and all(module_passes(m) for m in k.modules):
        unvouched = [f for f, vouched in k.code if not vouched]
        if unvouched:
            assert unvouched[0] in verdict.detail                   # the file the patched code comes from
        elif not k.code or k.code[-1][1] == k.modules[0].distribution:   # what is wrong is the compiled module
            e = k.extension_facts
            assert "extension" in verdict.detail or (e is not None and verdict.detail == judge_module(e).detail)


# -- the facts, read for real from temporary site folders -------------------------------------------

def record_row(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}\n"


def write_dist(site: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """What an installer leaves: the files, and a .dist-info whose RECORD lists each with its sha256."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    (info / "METADATA").write_bytes(metadata)
    rows = ""
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        rows += record_row(rel, data)
    (info / "RECORD").write_text(rows + record_row(f"{info.name}/METADATA", metadata) + f"{info.name}/RECORD,,\n")
    return info


def compile_extension(module: str, out: Path) -> bytes:
    """A real CPython extension module named `module` (what a kernel wheel's compiled part looks like
    to the import system), or skip where this machine cannot compile one."""
    include = Path(sysconfig.get_paths()["include"])
    if shutil.which("gcc") is None or not (include / "Python.h").is_file():
        pytest.skip("needs gcc and Python.h to compile a test extension")
    src = out / f"{module}.c"
    src.write_text("#include <Python.h>\n"
                   f"static struct PyModuleDef def = {{PyModuleDef_HEAD_INIT, \"{module}\", NULL, -1, NULL}};\n"
                   f"PyMODINIT_FUNC PyInit_{module}(void) {{ return PyModule_Create(&def); }}\n")
    so = out / f"{module}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{include}", "-o", str(so), str(src)], check=True)
    return so.read_bytes()


SUFFIX = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if "cpython" in s)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site folder first on sys.path; the modules imported from it are forgotten afterwards."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)


def test_an_installed_kernel_passes_and_a_changed_or_unlisted_file_fails_naming_it(site):
    write_dist(site, "ftprov-a", "1.0", {"ftprov_a/__init__.py": b"from ftprov_a.ops import fn\n",
                                         "ftprov_a/ops.py": b"def fn(x, seq_idx=None):\n    return x\n"})
    module = importlib.import_module("ftprov_a")
    verdict = judge_kernel(Survey().function_facts(module.fn, "triton", ""))
    assert verdict.ok and "from ftprov-a 1.0: 2 module(s)" in verdict.detail, verdict
    assert judge_kernel(Survey().package_facts("ftprov_a", "triton", "")).ok
    (site / "ftprov_a" / "ops.py").write_text("def fn(x, seq_idx=None):\n    return x * 0\n")
    changed = judge_kernel(Survey().function_facts(module.fn, "triton", ""))
    assert not changed.ok and f"{site}/ftprov_a/ops.py differs from the sha256 in the RECORD of ftprov-a 1.0" \
        in changed.detail and "reinstall ftprov-a 1.0" in changed.fix
    (site / "ftprov_a" / "extra.py").write_text("X = 1\n")
    importlib.import_module("ftprov_a.extra")
    unlisted = judge_kernel(Survey().package_facts("ftprov_a", "triton", ""))
    assert not unlisted.ok and "no installed distribution's RECORD lists" in unlisted.detail
    assert any(str(site / "ftprov_a" / name) in unlisted.detail for name in ("ops.py", "extra.py"))


def test_a_file_two_distributions_list_counts_for_the_one_whose_sha256_matches(site):
    """A package split over two wheels (fla-core and flash-linear-attention) can list one file twice."""
    write_dist(site, "ftprov-split-a", "1.0", {"ftprov_split/__init__.py": b"OLD = 1\n"})
    write_dist(site, "ftprov-split-b", "1.0", {"ftprov_split/__init__.py": b"def fn(x):\n    return x\n"})
    module = importlib.import_module("ftprov_split")
    verdict = judge_kernel(Survey().function_facts(module.fn, "triton", ""))
    assert verdict.ok and "ftprov-split-b 1.0" in verdict.detail, verdict


def test_a_cuda_extension_kernel_needs_its_compiled_module_from_its_own_distribution(site, tmp_path):
    own = compile_extension("ftprov_b_cuda", tmp_path)
    other = compile_extension("ftprov_c_cuda", tmp_path)
    write_dist(site, "ftprov-b", "1.0", {"ftprov_b/__init__.py": b"import ftprov_b_cuda\n",
                                         f"ftprov_b_cuda{SUFFIX}": own})
    write_dist(site, "ftprov-c", "1.0", {"ftprov_c/__init__.py": b"import ftprov_c_cuda\n"})
    write_dist(site, "someone-else", "2.0", {f"ftprov_c_cuda{SUFFIX}": other})
    write_dist(site, "ftprov-d", "1.0", {"ftprov_d/__init__.py": b"def fn(x):\n    return x\n"})
    for name in ("ftprov_b", "ftprov_c", "ftprov_d"):
        importlib.import_module(name)
    survey = Survey()
    ok = judge_kernel(survey.package_facts("ftprov_b", "cuda-extension", "ftprov_b_cuda"))
    assert ok.ok and "and its compiled ftprov_b_cuda" in ok.detail, ok
    elsewhere = judge_kernel(survey.package_facts("ftprov_c", "cuda-extension", "ftprov_c_cuda"))
    assert not elsewhere.ok and "someone-else 2.0" in elsewhere.detail and "not a compiled extension of ftprov-c" \
        in elsewhere.detail
    python_only = judge_kernel(survey.package_facts("ftprov_d", "cuda-extension", "ftprov_d_cuda"))
    assert not python_only.ok and "its compiled ftprov_d_cuda was never loaded" in python_only.detail
    assert judge_kernel(survey.package_facts("ftprov_d", "triton", "")).ok      # the same code, as a Triton kernel


HOOK = r'''
import importlib.abc, importlib.machinery, sys

class Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        exec("def fn(x, seq_idx=None):\n    return x\n", module.__dict__)

class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ftprov_served":
            return importlib.machinery.ModuleSpec(name, Loader(), origin=__file__)
        return None

class Redirect(importlib.abc.MetaPathFinder):
    """The standard loader, run on another file, under a spec that names the installed one."""
    def __init__(self, name, ran, claimed):
        self.name, self.ran, self.claimed = name, ran, claimed
    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        loader = importlib.machinery.SourceFileLoader(name, self.ran)
        return importlib.machinery.ModuleSpec(name, loader, origin=self.claimed)

class PathLoader(importlib.machinery.SourceFileLoader):
    """The standard loader's code, but not the standard loader."""

class Watcher(importlib.abc.MetaPathFinder):
    """Watches a name and hands it to the finders after it."""
    def find_spec(self, name, path=None, target=None):
        if name != "ftprov_watched":
            return None
        after = sys.meta_path[sys.meta_path.index(self) + 1:]
        return next(s for f in after for s in [f.find_spec(name, path, target)] if s)
'''


def test_a_hook_that_serves_a_module_is_named_and_one_that_only_watches_serves_nothing(site, tmp_path, monkeypatch):
    import guard.boot

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "ftprov_hooks.py").write_text(HOOK)
    monkeypatch.syspath_prepend(str(hooks))
    mod = importlib.import_module("ftprov_hooks")
    own = guard.boot.ModelingWatcher({"ftprov_watched": "f"}, on_loaded=lambda module, family: None)
    monkeypatch.setattr(sys, "meta_path", [own, mod.Watcher(), mod.Finder(), *sys.meta_path])
    served = importlib.import_module("ftprov_served")
    verdict = judge_kernel(Survey().function_facts(served.fn, "triton", ""))
    assert not verdict.ok and "served by an import hook" in verdict.detail
    assert f"loader ftprov_hooks.Loader (defined in {hooks / 'ftprov_hooks.py'})" in verdict.detail

    write_dist(site, "ftprov-w", "1.0", {"ftprov_watched/__init__.py": b"def fn(x):\n    return x\n"})
    watched = importlib.import_module("ftprov_watched")
    survey = Survey()
    assert judge_kernel(survey.function_facts(watched.fn, "triton", "")).ok   # two watchers, neither served it
    by_name = {h.name: h for h in survey.hooks}
    assert by_name["guard.boot.ModelingWatcher"].allowed and by_name["guard.boot.ModelingWatcher"].file == \
        OWN_WATCHER[1]
    assert not by_name["ftprov_hooks.Watcher"].allowed and not by_name["ftprov_hooks.Finder"].allowed

    write_dist(site, "ftprov-r", "1.0", {"ftprov_redirect/__init__.py": b"def fn(x):\n    return x\n"})
    (tmp_path / "ran.py").write_text("def fn(x):\n    return x * 0\n")
    redirect = mod.Redirect("ftprov_redirect", str(tmp_path / "ran.py"), str(site / "ftprov_redirect/__init__.py"))
    monkeypatch.setattr(sys, "meta_path", [redirect, *sys.meta_path])
    importlib.import_module("ftprov_redirect")
    verdict = judge_kernel(Survey().package_facts("ftprov_redirect", "triton", ""))
    assert not verdict.ok and "meta_path ftprov_hooks.Redirect" in verdict.detail, verdict

    write_dist(site, "ftprov-p", "1.0", {"ftprov_path/__init__.py": b"def fn(x):\n    return x\n"})
    monkeypatch.setattr(sys, "path_hooks", [importlib.machinery.FileFinder.path_hook((mod.PathLoader, [".py"])),
                                            *sys.path_hooks])
    monkeypatch.setattr(sys, "path_importer_cache", {})
    path_served = importlib.import_module("ftprov_path")
    verdict = judge_kernel(Survey().package_facts("ftprov_path", "triton", ""))
    assert type(path_served.__spec__.loader) is mod.PathLoader
    assert not verdict.ok and "ftprov_hooks.PathLoader" in verdict.detail and "ftprov_hooks.py" in verdict.detail


def test_the_own_hooks_and_kinds_verify_knows_are_this_checkout_s():
    """verify may not import guard/ or build/: its copies of their facts are pinned here."""
    import guard
    import guard.boot
    from build.spec import load_manifest

    assert OWN_PTH == {name: hashlib.sha256(data).hexdigest() for name, data in guard.install_files().items()}, \
        "guard.install_files() changed: update OWN_PTH in verify/provenance.py"
    assert Path(OWN_WATCHER[1]) == Path(guard.boot.__file__).resolve() and hasattr(guard.boot, OWN_WATCHER[0])
    manifest = {k.import_name: (k.kind, k.extension_module or "") for k in load_manifest().kernels.values()}
    assert MANIFEST_KINDS == manifest, "kernels_manifest.yaml changed: update MANIFEST_KINDS in verify/provenance.py"


def test_a_lock_says_the_kind_and_without_one_the_manifest_does():
    from tests.fixtures.locks import environment_lock, manifest_kernel

    lock = environment_lock(kernels=(manifest_kernel("causal-conv1d"),))
    assert kind_of("causal_conv1d", lock) == ("cuda-extension", "causal_conv1d_cuda")
    assert kind_of("fla", None) == ("triton", "") and kind_of("unknown_kernel", lock) == ("", "")


def test_the_contradiction_check_sees_what_the_old_table_said(contradictions):
    """The table a hostile .pth produced before: extensions.fla PASSed while the environment rows
    said no Triton kernel package was installed and named no kernel at all."""
    old = {"environment.kernels": {"check": "environment.kernels", "status": "SKIP",
                                   "detail": "no lock: the extensions rows report each installed kernel"},
           "environment.triton_runtime": {"check": "environment.triton_runtime", "status": "SKIP",
                                          "detail": "no Triton kernel package (fla) is installed, so no JIT"},
           "extensions.fla": {"check": "extensions.fla", "status": "PASS", "detail": "`fla` imports", "data": {}},
           "dispatch.causal_conv1d_fn": {"check": "dispatch.causal_conv1d_fn", "status": "PASS", "detail": "",
                                         "data": {"implementation": "causal_conv1d.causal_conv1d_fn"}}}
    found = contradictions(old)
    assert len(found) == 3 and any("environment.triton_runtime says" in p for p in found)
    assert contradictions({k: v for k, v in old.items() if not k.startswith("environment.")}) == []


# -- the table, in fresh interpreters --------------------------------------------------------------

SNEAKY = '''"""Serves modules named like kernels, from plain torch code that honours their boundary kwargs."""
import importlib.abc, importlib.util, os, sys

DOUBLES = {doubles!r}
SERVED = {{"causal_conv1d": "causal_conv1d/__init__.py", "fla": "fla/__init__.py", "fla.ops": "fla/ops/__init__.py",
          "fla.ops.gated_delta_rule": "fla/ops/gated_delta_rule/__init__.py"}}


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None):
    raise NotImplementedError


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    raise NotImplementedError


class Loader(importlib.abc.Loader):
    def __init__(self, path):
        self.path = path

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(self.path) as fh:
            exec(compile(fh.read(), self.path, "exec"), module.__dict__)
        module.causal_conv1d_update = causal_conv1d_update
        module.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        rel = SERVED.get(name)
        if rel is None:
            return None
        full = os.path.join(DOUBLES, rel)
        return importlib.util.spec_from_loader(name, Loader(full), origin=full, is_package=True)


def install():
    sys.meta_path.insert(0, Finder())
'''

PATCH = '''"""Lets the installed causal_conv1d load, then swaps its function; plants a fla of its own."""
import sys, types

DOUBLES = {doubles!r}
real = []


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    return real[0](x, weight, bias=bias, seq_idx=seq_idx, activation=activation)


causal_conv1d_fn.__module__ = "causal_conv1d"


class Watcher:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" and "fla" not in sys.modules:
            plant_fla()     # torch is on the path by then: a venv's own .pth runs before the system site
        if name != "causal_conv1d":
            return None
        after = sys.meta_path[sys.meta_path.index(self) + 1:]
        spec = next(s for f in after for s in [f.find_spec(name, path, target)] if s)
        plain = spec.loader.exec_module

        def exec_module(module):
            plain(module)
            real.append(module.causal_conv1d_fn)
            module.causal_conv1d_fn = causal_conv1d_fn
        spec.loader.exec_module = exec_module
        return spec


def plant(name, rel):
    module = types.ModuleType(name)
    module.__path__ = []
    exec(compile(open(DOUBLES + "/" + rel).read(), DOUBLES + "/" + rel, "exec"), module.__dict__)
    sys.modules[name] = module
    return module


def plant_fla():
    fla = plant("fla", "fla/__init__.py")
    fla.ops = plant("fla.ops", "fla/ops/__init__.py")
    fla.ops.gated_delta_rule = plant("fla.ops.gated_delta_rule", "fla/ops/gated_delta_rule/__init__.py")


def install():
    sys.meta_path.insert(0, Watcher())
'''


def make_venv(root: Path) -> tuple[Path, Path]:
    """A venv seeing this machine's torch and transformers; returns (python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(purelib)


def install_doubles(site: Path, scratch: Path) -> None:
    """tests/guard's CPU doubles as the installer would leave real kernels: causal-conv1d with a compiled
    causal_conv1d_cuda its package imports (as the real one does), and fla-core, each with its RECORD."""
    def files(package: str) -> dict[str, bytes]:
        return {p.relative_to(DOUBLES).as_posix(): p.read_bytes() for p in sorted((DOUBLES / package).rglob("*.py"))}

    conv = files("causal_conv1d")
    conv["causal_conv1d/__init__.py"] += b"\nimport causal_conv1d_cuda  # noqa: E402,F401 - its compiled part\n"
    conv[f"causal_conv1d_cuda{SUFFIX}"] = compile_extension("causal_conv1d_cuda", scratch)
    write_dist(site, "causal-conv1d", "1.7.0", conv)
    write_dist(site, "fla-core", "0.6.0", files("fla"))


def own_hooks(site: Path) -> None:
    """What build/ writes into an image's site-packages: the app .pth and the guard's."""
    import guard

    (site / guard.APP_PTH).write_text(f"{REPO}\n")
    for name, data in guard.install_files().items():
        (site / name).write_bytes(data)


@pytest.mark.slow
def test_a_pth_finder_serving_fake_kernels_no_longer_passes_any_row(tmp_path, run_verify, rows_by_check):
    """Before: extensions.causal_conv1d ("no compiled extension"), extensions.fla, the four bindings,
    dispatch.causal_conv1d_fn and the five isolation rows PASSed, beside a triton_runtime row that
    said no Triton kernel was installed."""
    python, site = make_venv(tmp_path / "venv")
    (site / "sneaky_kernels.py").write_text(SNEAKY.format(doubles=str(DOUBLES)))
    (site / "zz-kernels.pth").write_text("import sneaky_kernels; sneaky_kernels.install()\n")
    code, out, err = run_verify(*AUDIT, python=python)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    rows = rows_by_check(out)                    # and the table does not contradict itself
    for name in ["extensions.causal_conv1d", "extensions.fla", "dispatch.causal_conv1d_fn", *ISOLATION,
                 "extensions.binding.causal_conv1d_fn", "extensions.binding.torch_chunk_gated_delta_rule"]:
        row = rows[name]
        assert row["status"] == "FAIL", (name, row)
        assert f"defined in {site}/sneaky_kernels.py" in row["detail"] and f"{site}/zz-kernels.pth" in row["detail"], \
            (name, row["detail"])
        assert f"remove {site}/sneaky_kernels.py, {site}/zz-kernels.pth" in row["fix"], (name, row["fix"])
    assert all(rows[name]["status"] == "FAIL" for name in BINDINGS)
    assert "no Triton kernel package (fla, mamba_ssm) is on the path" in rows["environment.triton_runtime"]["detail"]


@pytest.mark.slow
def test_the_doubles_installed_as_distributions_pass_beside_the_image_own_hooks(tmp_path, run_verify, rows_by_check):
    """The positive control: the same torch code, installed with a RECORD (and causal-conv1d with its
    compiled module), in a site-packages that also holds the guard's .pth and its watcher, passes."""
    python, site = make_venv(tmp_path / "venv")
    install_doubles(site, tmp_path)
    own_hooks(site)
    code, out, err = run_verify(*AUDIT, python=python)
    rows = rows_by_check(out)
    passing = ["extensions.causal_conv1d", "extensions.fla", "extensions.binding.causal_conv1d_fn",
               "extensions.binding.torch_chunk_gated_delta_rule", "dispatch.causal_conv1d_fn", *ISOLATION]
    assert {n: rows[n]["status"] for n in passing} == dict.fromkeys(passing, "PASS"), \
        {n: rows[n]["detail"] for n in passing if rows[n]["status"] != "PASS"}
    assert "from causal-conv1d 1.7.0" in rows["dispatch.causal_conv1d_fn"]["detail"]
    assert "and its compiled causal_conv1d_cuda" in rows["extensions.causal_conv1d"]["detail"]
    kernels = rows["environment.kernels"]["detail"]
    assert "causal-conv1d 1.7.0 (`causal_conv1d`)" in kernels and "fla-core 0.6.0 (`fla`)" in kernels
    assert "no Triton kernel" not in rows["environment.triton_runtime"]["detail"]


@pytest.mark.slow
def test_a_pth_that_patches_an_installed_kernel_or_plants_modules_is_named(tmp_path, run_verify, rows_by_check):
    python, site = make_venv(tmp_path / "venv")
    install_doubles(site, tmp_path)
    (site / "kernel_patch.py").write_text(PATCH.format(doubles=str(DOUBLES)))
    (site / "zz-patch.pth").write_text("import kernel_patch; kernel_patch.install()\n")
    code, out, err = run_verify(*AUDIT, python=python)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    rows = rows_by_check(out)
    conv = rows["dispatch.causal_conv1d_fn"]
    assert conv["status"] == "FAIL" and f"runs code from {site}/kernel_patch.py, which no installed distribution's " \
        "RECORD lists" in conv["detail"], conv
    assert rows["extensions.causal_conv1d"]["status"] == "PASS"     # the package itself is the installed one
    planted = rows["extensions.fla"]
    assert planted["status"] == "FAIL" and "`fla` has no import spec" in planted["detail"]
    assert f".pth {site}/zz-patch.pth" in planted["detail"], planted
    assert all(rows[name]["status"] == "FAIL" for name in ISOLATION)
