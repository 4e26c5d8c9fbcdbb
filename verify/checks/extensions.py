"""Extensions: what only an image this project did not build can get wrong in its kernels.

An ftimage image compiles every kernel wheel against its own torch, checks it at build time and
records it in the lock. Another image's flash-attn or causal-conv1d may come from anywhere: a
wheel for another torch, another CUDA, the other C++ ABI, or archs that leave out this GPU.
transformers hides all of it: use_kernel_func_from_hub_with_fallback catches the import error
at import time and quietly uses the torch reference. Per kernel package these rows say:

- `extensions.<package>`: installed, and whether it and each compiled extension import (the
  real error, e.g. "undefined symbol: _ZN3c10..."), and where they came from: every loaded
  module of it from an installed distribution's RECORD by the standard loaders, no import hook
  serving it, and a cuda-extension's compiled module loaded from that same distribution
  (verify.provenance);
- `extensions.<package>.abi`: the C++ ABI (torch._C._GLIBCXX_USE_CXX11_ABI against the wheel's
  local version tag, else the std::string mangling of the torch symbols it expects) and the
  torch/CUDA version it was built for (its local version tag, its wheel file name, the
  libcudart it links);
- `extensions.<package>.sass`: the archs in its fatbin against this GPU;
- `extensions.binding.<wrapper>`: each of the modeling module's fallback bindings, and the
  error it caught (families.binding.explain_fallback re-imports the package to get it); a bound
  kernel counts only where verify.provenance says it came from its distribution.

Run by `verify --no-lock` (the audit of a foreign image: `python -m build audit IMAGE`), or by
`--checks extensions` in any image.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from families.binding import Resolution, describe, explain_fallback, read_resolution, transformers_symbol
from verify.context import Context
from verify.elf_facts import NotElf, cuda_runtime_major, cxx11_abi_of, read_facts
from verify.import_facts import Survey
from verify.provenance import Verdict, judge_kernel, kind_of, refusal
from verify.report import CheckResult, Status

REQUIRES = ("transformers",)   # the bindings live in its modeling code
ATTENTION_PACKAGE = "flash_attn"   # what transformers' flash_attention_2 imports


@dataclass(frozen=True)
class BuiltFor:
    """What a wheel says it was built for (flash-attn style local tags: +cu12torch2.7cxx11abiTRUE)."""

    torch: str | None = None        # "2.7"
    cuda_major: int | None = None   # 12
    cxx11_abi: bool | None = None
    source: str = ""


@dataclass(frozen=True)
class AbiFacts:
    torch_version: str
    torch_cuda: str | None
    torch_abi: bool | None          # torch._C._GLIBCXX_USE_CXX11_ABI
    built_for: BuiltFor = BuiltFor()
    symbol_abi: bool | None = None  # from the extension's undefined torch symbols
    cudart_major: int | None = None
    extensions: tuple[str, ...] = ()


def _cuda_major(tag: str) -> int:
    """cu12 -> 12, cu118 -> 11, cu130 -> 13."""
    return int(tag) if len(tag) <= 2 else int(tag[:-1])


def parse_built_for(version: str, wheel_name: str = "") -> BuiltFor:
    """The local version tag of the installed version, else of the wheel it was installed from."""
    for label, text in (("local version tag", version.partition("+")[2]),
                        ("wheel file name", wheel_name.split("-")[1].partition("+")[2]
                         if wheel_name.count("-") >= 2 else "")):
        if not text:
            continue
        cuda = re.search(r"cu(\d{2,4})", text)
        torch = re.search(r"torch(\d+\.\d+)", text)
        abi = re.search(r"cxx11abi(TRUE|FALSE)", text, re.I)
        if cuda or torch or abi:
            return BuiltFor(torch=torch.group(1) if torch else None,
                            cuda_major=_cuda_major(cuda.group(1)) if cuda else None,
                            cxx11_abi=abi.group(1).upper() == "TRUE" if abi else None, source=f"{label} +{text}")
    return BuiltFor()


def decide_import(package: str, distribution: str | None, version: str | None, installed: bool, error: str,
                  extension_errors: dict[str, str], *, provenance: Verdict | None) -> CheckResult:
    """Pure: the package and each compiled extension module (module -> error, "" if it imports), and
    where the imported package came from (None: not read, which never passes)."""
    row = f"extensions.{package}"
    name = f"{distribution} {version}" if distribution and version else f"`{package}`"
    data = {"distribution": distribution, "version": version, "extensions": extension_errors,
            "provenance": provenance.data if provenance else None}
    if not installed:
        return CheckResult(row, Status.SKIP, f"`{package}` is not installed (the dispatch rows say what transformers "
                           "runs instead)", data=data)
    broken = {m: e for m, e in extension_errors.items() if e}
    if error or broken:
        shown = f"`import {package}` raises {error}" if error else "; ".join(
            f"`import {m}` raises {e}" for m, e in broken.items())
        abi = "undefined symbol" in (error + " ".join(broken.values()))
        fix = (f"{name} was compiled against another torch (an undefined symbol is an ABI mismatch): rebuild it "
               "from source against this image's torch, or build the image with `python -m build`"
               if abi else f"{name} cannot load in this image (error in DETAIL): install a build for this image's "
               "torch, CUDA and Python")
        return CheckResult(row, Status.FAIL, f"{name} is installed but {shown}", fix, data)
    modules = ", ".join(extension_errors) or "no compiled extension"
    imports = f"{name} imports; {modules}" + (" import" if extension_errors else "")
    if refused := refusal(provenance):
        return CheckResult(row, Status.FAIL, f"{imports}, but {refused[0]}", refused[1], data)
    return CheckResult(row, Status.PASS, f"{imports}; {provenance.detail}", data=data)


def decide_abi(package: str, facts: AbiFacts) -> CheckResult:
    """Pure: the extension's C++ ABI and the torch/CUDA it was built for, against this torch."""
    row = f"extensions.{package}.abi"
    tag = facts.built_for
    data = {"torch": facts.torch_version, "torch_cuda": facts.torch_cuda, "torch_cxx11_abi": facts.torch_abi,
            "built_for_torch": tag.torch, "built_for_cuda": tag.cuda_major, "tag_cxx11_abi": tag.cxx11_abi,
            "symbol_cxx11_abi": facts.symbol_abi, "libcudart": facts.cudart_major, "source": tag.source}
    if not facts.extensions:
        return CheckResult(row, Status.SKIP, "no compiled extension (pure Python; Triton kernels compile in this "
                           "image at first use): no C++ ABI to compare", data=data)
    wheel_abi, abi_source = ((tag.cxx11_abi, tag.source) if tag.cxx11_abi is not None
                             else (facts.symbol_abi, "the torch symbols it links"))
    cuda, cuda_source = ((tag.cuda_major, tag.source) if tag.cuda_major is not None
                         else (facts.cudart_major, f"links libcudart.so.{facts.cudart_major}"))
    torch_mm = ".".join(facts.torch_version.split("+")[0].split(".")[:2])
    problems, matched = [], []
    if wheel_abi is not None and facts.torch_abi is not None:
        (problems if wheel_abi != facts.torch_abi else matched).append(
            f"compiled with _GLIBCXX_USE_CXX11_ABI={int(wheel_abi)} ({abi_source}); this torch has "
            f"torch._C._GLIBCXX_USE_CXX11_ABI={int(facts.torch_abi)}")
    if tag.torch is not None:
        (problems if tag.torch != torch_mm else matched).append(
            f"built for torch {tag.torch} ({tag.source}); the image has torch {facts.torch_version}")
    if cuda is not None:
        if facts.torch_cuda is None:
            problems.append(f"a CUDA {cuda} extension ({cuda_source}), but the image's torch is a CPU build")
        else:
            have = int(facts.torch_cuda.split(".")[0])
            (problems if have != cuda else matched).append(
                f"built for CUDA {cuda} ({cuda_source}); the image's torch is CUDA {facts.torch_cuda}")
    if problems:
        return CheckResult(row, Status.FAIL, "; ".join(problems),
                           f"rebuild {package} from source against this image's torch {facts.torch_version} "
                           f"(CUDA {facts.torch_cuda or 'none'}, _GLIBCXX_USE_CXX11_ABI="
                           f"{int(facts.torch_abi) if facts.torch_abi is not None else '?'}), or build the image "
                           "with `python -m build`, which compiles its kernels against its own torch", data)
    if not matched:
        return CheckResult(row, Status.SKIP, "the extension states no ABI, torch or CUDA it was built for (no local "
                           "version tag, no torch symbols, no libcudart): the import row is the proof", data=data)
    return CheckResult(row, Status.PASS, "; ".join(matched), data=data)


def decide_sass(package: str, sass: tuple[int, ...], ptx: tuple[int, ...], gpu: tuple[int, int] | None,
                has_extension: bool = True) -> CheckResult:
    """Pure: does the fatbin hold code this GPU runs? SASS of the same major and a lower or equal
    minor runs (sm_80 on sm_86); PTX at or below the GPU is JIT-compiled by the driver (slow start)."""
    row = f"extensions.{package}.sass"
    fmt = lambda nums: ", ".join(f"sm_{n}" for n in nums) or "none"  # noqa: E731
    data = {"sass": [f"sm_{n}" for n in sass], "ptx": [f"sm_{n}" for n in ptx],
            "gpu": f"sm_{gpu[0]}{gpu[1]}" if gpu else None}
    if not has_extension:
        return CheckResult(row, Status.SKIP, "no compiled extension: its kernels are compiled in this image, for "
                           "this GPU, at first use", data=data)
    if not sass and not ptx:
        return CheckResult(row, Status.SKIP, "its extensions hold no CUDA device code", data=data)
    held = f"SASS {fmt(sass)}; PTX {fmt(ptx)}"
    if gpu is None:
        return CheckResult(row, Status.SKIP, f"{held}; no GPU here to compare with (audit with --gpus)", data=data)
    arch = gpu[0] * 10 + gpu[1]
    if arch in sass:
        return CheckResult(row, Status.PASS, f"{held}: SASS for this GPU (sm_{arch})", data=data)
    compatible = [n for n in sass if n // 10 == gpu[0] and n % 10 <= gpu[1]]
    if compatible:
        return CheckResult(row, Status.PASS, f"{held}: sm_{max(compatible)} SASS runs on this sm_{arch} "
                           "(binary compatible within a major)", data=data)
    fix = (f"rebuild {package} with sm_{arch} in TORCH_CUDA_ARCH_LIST (e.g. `{gpu[0]}.{gpu[1]}`), or build the image "
           f"with `python -m build` and sm_{arch} in its target_archs")
    jit = [n for n in ptx if n <= arch]
    if jit:
        return CheckResult(row, Status.WARN, f"{held}: no SASS for this sm_{arch}; the driver JIT-compiles "
                           f"compute_{max(jit)} PTX at first use (minutes per process, and only where its JIT is as "
                           "new as the PTX)", fix, data)
    return CheckResult(row, Status.FAIL, f"{held}: nothing runs on this sm_{arch} (\"no kernel image is available "
                       "for execution on the device\")", fix, data)


def decide_binding(wrapper: str, res: Resolution, installed: bool, why: str, *,
                   provenance: Verdict | None) -> CheckResult:
    """Pure: one use_kernel_func_from_hub_with_fallback binding, what it caught at import, and where
    a bound kernel came from (None: not read, which never passes)."""
    row = f"extensions.binding.{wrapper}"
    data = {"package": res.package, "implementation": describe(res.implementation), "is_new": res.is_new,
            "provenance": provenance.data if provenance else None}
    if not res.readable:
        return CheckResult(row, Status.FAIL, f"cannot read the binding: {res.error}",
                           "audit with the transformers version verify/ was written for", data)
    if res.is_new and (refused := refusal(provenance)):
        return CheckResult(row, Status.FAIL, f"bound to {describe(res.implementation)} from `{res.package}`, but "
                           f"{refused[0]}", refused[1], data)
    if res.is_new:
        return CheckResult(row, Status.PASS, f"bound to {describe(res.implementation)} from `{res.package}`; "
                           f"caught nothing; {provenance.detail}", data=data)
    if not installed:
        return CheckResult(row, Status.SKIP, f"`{res.package}` is not installed, so the binding fell back to "
                           f"{describe(res.implementation)} (the dispatch rows say what that costs)", data=data)
    return CheckResult(row, Status.FAIL, f"caught an import error and fell back to {describe(res.implementation)}: "
                       f"{why}", f"`{res.package}` is installed but broken here: install a build for this image's "
                       "torch/CUDA (the extensions rows above name the mismatch)", {**data, "error": why})


# -- gathering the facts in the image ------------------------------------------------------------

@dataclass
class Installed:
    package: str
    distribution: str | None = None
    version: str | None = None
    wheel_name: str = ""
    extensions: dict[str, Path] = field(default_factory=dict)   # module -> file

    @property
    def present(self) -> bool:
        return self.distribution is not None or _find_spec(self.package) is not None


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _module_of(relative: str) -> str | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if relative.endswith(suffix):
            parts = relative[: -len(suffix)].split("/")
            return ".".join(parts) if all(p.isidentifier() for p in parts) else None
    return None


def locate(package: str, distribution: str | None = None) -> Installed:
    """The installed distribution behind an import name, and its compiled extension modules."""
    names = [distribution] if distribution else []
    names += importlib.metadata.packages_distributions().get(package, [])
    dist = None
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    found = Installed(package)
    if dist is None:
        spec = _find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for so in Path(folder).rglob("*.so"):
                module = _module_of(f"{package}/{so.relative_to(folder).as_posix()}")
                if module:
                    found.extensions[module] = so
        return found
    found.distribution, found.version = dist.metadata["Name"], dist.version
    try:
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    except ValueError:
        url = ""
    found.wheel_name = url.rsplit("/", 1)[-1] if url.endswith(".whl") else ""
    for f in dist.files or ():
        module = _module_of(str(f)) if not str(f).startswith("..") else None
        if module:
            found.extensions[module] = Path(dist.locate_file(f))
    return found


def _import_error(module: str) -> str:
    try:
        importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - the failure is the finding
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return ""


def package_rows(inst: Installed, gpu: tuple[int, int] | None, survey: Survey | None = None,
                 kind: tuple[str, str] = ("", "")) -> list[CheckResult]:
    """kind: (kind, compiled extension) from the lock, or the manifest's catalogue (provenance.kind_of)."""
    import torch  # see run()

    if not inst.present:
        return [decide_import(inst.package, None, None, False, "", {}, provenance=None)]
    error = _import_error(inst.package)
    errors = {m: _import_error(m) for m in inst.extensions}
    # read after the imports: the facts are about the modules this process really loaded
    origin = judge_kernel((survey or Survey()).package_facts(inst.package, *kind)) if not error else None
    rows = [decide_import(inst.package, inst.distribution, inst.version, True, error, errors, provenance=origin)]
    sass: set[int] = set()
    ptx: set[int] = set()
    undefined: list[str] = []
    cudart = None
    for path in inst.extensions.values():
        try:
            facts = read_facts(path)
        except (OSError, NotElf):
            continue
        sass |= set(facts.sass)
        ptx |= set(facts.ptx)
        undefined += facts.undefined
        cudart = cudart or cuda_runtime_major(facts.needed)
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    facts = AbiFacts(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                     torch_abi=bool(abi) if abi is not None else None,
                     built_for=parse_built_for(inst.version or "", inst.wheel_name),
                     symbol_abi=cxx11_abi_of(tuple(undefined)), cudart_major=cudart,
                     extensions=tuple(inst.extensions))
    rows.append(decide_abi(inst.package, facts))
    rows.append(decide_sass(inst.package, tuple(sorted(sass)), tuple(sorted(ptx)), gpu, bool(inst.extensions)))
    if kind[0] == "cuda-extension" and not inst.extensions:
        # not "pure Python": the lock (or the manifest) says this package is compiled
        why = (f"no compiled extension found, though `{inst.package}` is a cuda-extension kernel ({kind[1]}): "
               f"see extensions.{inst.package}")
        rows[1:] = [CheckResult(r.check, r.status, why, r.fix, r.data) for r in rows[1:]]
    return rows


def bindings_of(module) -> dict[str, Resolution]:
    """Every use_kernel_func_from_hub_with_fallback binding of a modeling module, by attribute
    (families.binding reads each closure, looking through a wrapper put around it)."""
    found = {}
    for name, obj in sorted(vars(module).items()):
        if not inspect.isfunction(obj):
            continue
        try:
            res = read_resolution(module, name)
        except (TypeError, ValueError):
            continue
        if res.readable:
            found[name] = res
    return found


def run(ctx: Context) -> list[CheckResult]:
    # torch (and families.runtime, which imports it) only inside run(): the runner imports this module
    # outside the try that makes a crash a FAIL row, and an audited image's torch may fail to import
    import torch

    from families.runtime import modeling_module

    module = modeling_module(ctx.family)   # transformers binds its kernels here, at import
    bindings = bindings_of(module)
    gpu = torch.cuda.get_device_capability(0) if torch.cuda.is_available() and torch.cuda.device_count() else None
    wanted: dict[str, str | None] = {}
    if ctx.lock is not None:
        wanted.update((k.import_name, k.distribution) for k in ctx.lock.kernels)
    else:
        wanted.update((r.package, None) for r in bindings.values() if r.package)
        wanted.setdefault(ATTENTION_PACKAGE, None)
    rows = []
    survey = Survey()
    for package, distribution in wanted.items():
        rows.extend(package_rows(locate(package, distribution), gpu, survey, kind_of(package, ctx.lock)))
    for wrapper, res in bindings.items():
        installed = _find_spec(res.package) is not None if res.package else False
        symbol, distribution = transformers_symbol(res)
        why = "" if res.is_new or not res.readable else explain_fallback(
            res.package, symbol, locate(res.package).distribution or distribution)
        origin = judge_kernel(survey.function_facts(res.implementation, *kind_of(res.package, ctx.lock))) \
            if res.is_new and res.readable else None
        rows.append(decide_binding(wrapper, res, installed, why, provenance=origin))
    return rows
