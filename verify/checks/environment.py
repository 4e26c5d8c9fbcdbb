"""Environment: the device, the driver, and that what is installed is what the lock says."""
from __future__ import annotations

import base64
import ctypes
import hashlib
import importlib.metadata
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from contracts.lock import BuildLock, LockedKernel, LockedPackage
from verify.checks.run_as import user_row
from verify.context import Context
from verify.import_facts import Survey
from verify.provenance import MANIFEST_KINDS
from verify.report import CheckResult, Status

REBUILD = "rebuild the image with `python -m build`; do not pip install over a built image"
HASH_SIZE_CAP = 16 * 1024 * 1024  # files above this are counted, not hashed, unless --deep


def decide_cuda_device(available: bool, count: int, name: str = "") -> CheckResult:
    if not available or count == 0:
        return CheckResult("environment.cuda_device", Status.FAIL, "no CUDA device",
                           "run with `docker run --gpus all` on a host with the NVIDIA container toolkit; "
                           "to exercise only the CPU probes: verify --device cpu --checks dispatch,isolation")
    return CheckResult("environment.cuda_device", Status.PASS, f"{count} device(s); cuda:0 = {name}")


def decide_arch(capability: tuple[int, int], target_archs: tuple[str, ...]) -> CheckResult:
    arch = f"sm_{capability[0]}{capability[1]}"
    if arch in target_archs:
        return CheckResult("environment.arch", Status.PASS,
                           f"{arch} is in the lock's target_archs {list(target_archs)}")
    return CheckResult("environment.arch", Status.FAIL,
                       f"device is {arch}; the kernels were built for {list(target_archs) or 'no GPU arch'} only "
                       "(no PTX fallback for other archs)", f"add {arch} to the image's target_archs and rebuild")


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def decide_driver(driver_version: int | None, lock_cuda: str) -> CheckResult:
    """driver_version is cudaDriverGetVersion's integer, e.g. 13000 for CUDA 13.0."""
    if lock_cuda == "cpu":
        return CheckResult("environment.driver", Status.FAIL, "the lock is a CPU image (cuda=cpu): no CUDA "
                           "kernels to run", "use an image built with a CUDA toolkit for GPU training")
    if not driver_version:
        return CheckResult("environment.driver", Status.FAIL, "cannot read the CUDA driver version",
                           "install an NVIDIA driver and run with --gpus all")
    have = (driver_version // 1000, (driver_version % 1000) // 10)
    need = _major_minor(lock_cuda)
    if have < need:
        return CheckResult("environment.driver", Status.FAIL,
                           f"driver supports CUDA {have[0]}.{have[1]}, the image needs {lock_cuda}",
                           f"upgrade the host driver to one supporting CUDA {lock_cuda}")
    return CheckResult("environment.driver", Status.PASS, f"driver supports CUDA {have[0]}.{have[1]} >= {lock_cuda}")


def decide_versions(lock: BuildLock, python: str, torch_version: str, torch_cuda: str | None,
                    transformers_version: str | None) -> list[CheckResult]:
    """Versions as the installed distributions' metadata report them, compared exactly with the
    lock (which recorded the wheels' metadata). torch.__version__ is not compared: PyTorch's CUDA
    wheel says 2.14.1+cu130 there and 2.14.1 in its metadata. A +cpu torch (metadata 2.14.1+cpu)
    never matches, and the torch_cuda row checks the build's CUDA separately."""
    rows = []
    want_cuda = None if lock.cuda == "cpu" else lock.cuda
    pairs = [("python", lock.python, python), ("torch", lock.torch, torch_version),
             ("torch_cuda", want_cuda or "none", torch_cuda or "none")]
    if transformers_version is None and not lock.transformers:
        rows_transformers = CheckResult("environment.transformers", Status.SKIP,
                                        "this image ships no transformers (its lock records none), so there is no "
                                        "modeling code to check here")
    elif transformers_version is None:
        rows_transformers = CheckResult("environment.transformers", Status.FAIL,
                                        f"transformers {lock.transformers} is in the lock but not installed", REBUILD)
    else:
        rows_transformers = None
        pairs.append(("transformers", lock.transformers, transformers_version))
    for what, want, have in pairs:
        ok = have == want or (what == "python" and have.startswith(want + "."))
        rows.append(CheckResult(f"environment.{what}", Status.PASS if ok else Status.FAIL,
                                f"{have}" + ("" if ok else f", the lock says {want}"), "" if ok else REBUILD))
    if rows_transformers is not None:
        rows.append(rows_transformers)
    return rows


def _record_mismatches(dist: importlib.metadata.Distribution, deep: bool) -> tuple[int, int, list[str]]:
    """(hashed, skipped, mismatches) for the files listed in the dist's RECORD."""
    hashed = skipped = 0
    bad: list[str] = []
    for f in dist.files or ():
        if f.hash is None or f.hash.mode != "sha256":
            continue
        path = Path(dist.locate_file(f))
        try:
            if not deep and path.stat().st_size > HASH_SIZE_CAP:
                skipped += 1
                continue
            digest = hashlib.sha256(path.read_bytes()).digest()
        except OSError:
            bad.append(f"{f} (missing)")
            continue
        hashed += 1
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value:
            bad.append(str(f))
    return hashed, skipped, bad


def decide_installed(what: str, name: str, want_version: str, have_version: str | None,
                     hashed: int, skipped: int, bad: list[str], extra: str = "") -> CheckResult:
    row = f"environment.{what}.{name}"
    if have_version is None:
        return CheckResult(row, Status.FAIL, f"{name} {want_version} is in the lock but not installed", REBUILD)
    if have_version != want_version:
        return CheckResult(row, Status.FAIL, f"installed {have_version}, the lock says {want_version}", REBUILD)
    if bad:
        shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        return CheckResult(row, Status.FAIL, f"{len(bad)} file(s) differ from the wheel's RECORD: {shown}",
                           REBUILD, {"mismatches": bad})
    note = f"{hashed} file(s) match RECORD" + (f", {skipped} over {HASH_SIZE_CAP >> 20} MiB not hashed "
                                              "(--deep hashes them)" if skipped else "")
    return CheckResult(row, Status.PASS, f"{have_version}; {note}{extra}", data={"hashed": hashed, "skipped": skipped})


def _version(name: str) -> str | None:
    dist = _dist(name)
    return dist.version if dist else None


def _dist(name: str):
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_installed(entries: list[LockedPackage | LockedKernel], deep: bool) -> list[CheckResult]:
    rows = []
    for entry in entries:
        what = "kernel" if isinstance(entry, LockedKernel) else "package"
        name = entry.distribution if isinstance(entry, LockedKernel) else entry.name
        dist = _dist(name)
        extra = ""
        if isinstance(entry, LockedKernel):
            if len(entry.sha256) != 64:
                rows.append(CheckResult(f"environment.kernel.{name}", Status.FAIL,
                                        f"the lock records no wheel sha256 for {entry.wheel!r}", REBUILD))
                continue
            extra = f"; wheel {entry.wheel} sha256 {entry.sha256[:12]}"
        if dist is None:
            rows.append(decide_installed(what, name, entry.version, None, 0, 0, []))
            continue
        # Kernels are small and are where ABI damage hides: always hash them fully.
        hashed, skipped, bad = _record_mismatches(dist, deep or what == "kernel")
        rows.append(decide_installed(what, name, entry.version, dist.version, hashed, skipped, bad, extra))
    return rows


def summarize_packages(rows: list[CheckResult]) -> list[CheckResult]:
    """One row for all matching packages (a real lock has dozens); every mismatch keeps its own row."""
    bad = [r for r in rows if r.status is not Status.PASS]
    good = [r for r in rows if r.status is Status.PASS]
    if not good:
        return bad
    hashed = sum(r.data.get("hashed", 0) for r in good)
    skipped = sum(r.data.get("skipped", 0) for r in good)
    names = [r.check.removeprefix("environment.package.") for r in good]
    note = f", {skipped} over {HASH_SIZE_CAP >> 20} MiB not hashed (--deep hashes them)" if skipped else ""
    summary = CheckResult("environment.packages", Status.PASS,
                          f"{len(good)} locked package(s) installed at the locked version; {hashed} file(s) match "
                          f"their wheels' RECORD{note}", data={"packages": names, "hashed": hashed, "skipped": skipped})
    return bad + [summary]


def decide_runtime_constraints(kernels: list[LockedKernel], arch: str | None,
                               installed: dict[str, str | None]) -> list[CheckResult]:
    """What a kernel needs installed to run on this arch (the lock carries it from the manifest),
    e.g. fla's Triton >= 3.7.1 on Hopper: older Triton gives wrong gradients there, and fla
    refuses its backward mid-step instead."""
    # packaging may be absent (torch does not need it): inside run(), a missing one is a FAIL row
    from packaging.specifiers import SpecifierSet

    rows = []
    for kernel in kernels:
        for c in kernel.runtime_constraints:
            if c.archs and arch not in c.archs:
                continue
            have = installed.get(c.package)
            row = f"environment.runtime.{kernel.distribution}.{c.package}"
            where = f" on {arch}" if c.archs else ""
            if have is None:
                rows.append(CheckResult(row, Status.FAIL, f"{kernel.distribution} needs {c.package}{c.version}{where}, "
                                        f"which is not installed ({c.reason})", REBUILD))
            elif not SpecifierSet(c.version).contains(have, prereleases=True):
                rows.append(CheckResult(row, Status.FAIL, f"{c.package} {have} is installed; {kernel.distribution} "
                                        f"needs {c.package}{c.version}{where}: {c.reason}",
                                        f"install {c.package}{c.version} (the image's toolchain brings it); "
                                        "do not train here until then"))
            else:
                rows.append(CheckResult(row, Status.PASS, f"{c.package} {have} satisfies {c.version}{where} "
                                        f"for {kernel.distribution}"))
    return rows


def decide_triton_runtime(needed: bool, compiler: str | None, python_h: Path, cache_dir: Path,
                          cache_writable: bool, cache_exec: bool = True) -> CheckResult:
    row = "environment.triton_runtime"
    if not needed:
        return CheckResult(row, Status.SKIP, "the lock has no triton-kind kernel, so no JIT at run time")
    missing, fixes = [], []
    if not compiler:
        missing.append("no C compiler (gcc/clang/cc or $CC)")
        fixes.append("install gcc in the runtime image")
    if not python_h.is_file():
        missing.append(f"no {python_h}")
        fixes.append(f"install python{sys.version_info.major}.{sys.version_info.minor}-dev headers")
    if not cache_writable:
        missing.append(f"cache dir {cache_dir} not writable")
        fixes.append("set TRITON_CACHE_DIR to a writable path (the image runs as non-root)")
    elif not cache_exec:
        missing.append(f"cache dir {cache_dir} is on a noexec mount, so the launcher it compiles there cannot load")
        fixes.append("mount that folder with exec (docker and podman: --tmpfs /tmp:exec; their default is noexec), "
                     "or set TRITON_CACHE_DIR to a folder on a mount that allows exec")
    if missing:
        return CheckResult(row, Status.FAIL, "Triton builds a C launcher at first GPU call and will fail: "
                           + "; ".join(missing), "; ".join(fixes))
    return CheckResult(row, Status.PASS, f"compiler {compiler}, {python_h.name} present, cache {cache_dir} writable")


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _exec_mount(path: Path) -> bool:
    """Whether shared objects under `path` can be loaded: Triton dlopens the launcher it compiles
    into its cache, and a noexec mount refuses that at the first GPU call."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return not os.statvfs(path).f_flag & os.ST_NOEXEC
    except OSError:
        return True   # unknown here: the writability check speaks for the folder


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            return True
    except OSError:
        return False


def find_compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return shutil.which(cc)
    for name in ("gcc", "clang", "cc"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def driver_version() -> int | None:
    """cudaDriverGetVersion's integer (13000 = CUDA 13.0), from torch or straight from libcuda."""
    import torch  # see run()

    try:
        return int(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - private API; fall back to the driver library itself
        pass
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def run(ctx: Context) -> list[CheckResult]:
    # torch only inside run(): the runner imports this module outside the try that makes a crash a FAIL row
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    rows = [user_row(), decide_cuda_device(available, count, torch.cuda.get_device_name(0) if count else "")]
    lock = ctx.lock
    if lock is None and ctx.no_lock:
        return rows + without_lock(count, torch)
    if lock is None:
        rows.append(CheckResult("environment.lock", Status.FAIL, "no lock to compare the installation with",
                                "see the lock row"))
        return rows
    arch = None
    if count:
        capability = torch.cuda.get_device_capability(0)
        arch = f"sm_{capability[0]}{capability[1]}"
        rows.append(decide_arch(capability, lock.target_archs))
        rows.append(decide_driver(driver_version(), lock.cuda))
    else:
        rows.append(CheckResult("environment.arch", Status.FAIL, "no CUDA device to compare with the lock's "
                                f"target_archs {list(lock.target_archs)}", "see environment.cuda_device"))
    python = ".".join(map(str, sys.version_info[:3]))
    rows.extend(decide_versions(lock, python, _version("torch") or torch.__version__, torch.version.cuda,
                                _version("transformers")))
    rows.extend(check_installed(list(lock.kernels), ctx.deep))
    rows.extend(summarize_packages(check_installed(list(lock.packages), ctx.deep)))
    wanted = {c.package for k in lock.kernels for c in k.runtime_constraints}
    rows.extend(decide_runtime_constraints(list(lock.kernels), arch, {p: _version(p) for p in wanted}))
    needed = any(k.kind == "triton" for k in lock.kernels)
    cache = triton_cache_dir()
    rows.append(decide_triton_runtime(needed, find_compiler(), Path(sysconfig.get_paths()["include"]) / "Python.h",
                                      cache, _writable(cache) if needed else False, _exec_mount(cache)))
    return rows


NO_LOCK = "no lock (--no-lock, an audit)"


def decide_kernels_on_disk(found: dict[str, tuple[str, str]]) -> CheckResult:
    """Pure: the manifest's kernel packages where the standard finder would import them from (import
    name -> (the distribution whose RECORD lists that file with its sha256, the file)), without a lock."""
    shown = []
    for package, (distribution, file) in found.items():
        if distribution:
            shown.append(f"{distribution} (`{package}`)")
        elif file:
            shown.append(f"`{package}` at {file}, which no installed distribution's RECORD vouches for")
    absent = ", ".join(f"`{p}`" for p, (_, file) in found.items() if not file)
    listed = "; ".join(shown) or "none"
    return CheckResult("environment.kernels", Status.SKIP,
                       f"{NO_LOCK}: no locked kernel wheels to compare; kernel packages on the path: {listed}"
                       + (f"; not installed: {absent}" if absent else "") + "; the extensions rows prove each one",
                       data={"kernels": {p: {"distribution": d, "file": f} for p, (d, f) in found.items()}})


def without_lock(device_count: int, torch) -> list[CheckResult]:
    """The rows of an image without an ftimage lock: what is installed is reported, every
    comparison with a lock is SKIP, and what needs no lock is still checked: the driver
    against the CUDA this torch was built for, and Triton's runtime when fla is on the path."""
    python = ".".join(map(str, sys.version_info[:3]))
    versions = {"python": python, "torch": _version("torch") or torch.__version__,
                "torch_cuda": torch.version.cuda, "transformers": _version("transformers")}
    shown = ", ".join(f"{k} {v or 'none'}" for k, v in versions.items())
    rows = []
    if device_count:
        rows.append(CheckResult("environment.arch", Status.SKIP, f"{NO_LOCK}: no target_archs to compare with; the "
                                "extensions rows compare each kernel's SASS with this GPU"))
        if torch.version.cuda:
            driver = decide_driver(driver_version(), ".".join(torch.version.cuda.split(".")[:2]))
            rows.append(CheckResult(driver.check, driver.status, f"{driver.detail} (the CUDA this torch was built "
                                    "for)", driver.fix))
    rows.append(CheckResult("environment.versions", Status.SKIP, f"{shown}; {NO_LOCK}: nothing to compare them with",
                            data=versions))
    survey = Survey()
    found = {package: survey.on_disk(package) for package in MANIFEST_KINDS}
    rows.append(decide_kernels_on_disk(found))
    triton = [p for p, (_, file) in found.items() if file and MANIFEST_KINDS[p][0] == "triton"]
    if not triton:
        names = ", ".join(p for p, (kind, _) in MANIFEST_KINDS.items() if kind == "triton")
        rows.append(CheckResult("environment.triton_runtime", Status.SKIP, f"no Triton kernel package ({names}) is "
                                "on the path, so no JIT at run time"))
        return rows
    cache = triton_cache_dir()
    rows.append(decide_triton_runtime(True, find_compiler(), Path(sysconfig.get_paths()["include"]) / "Python.h",
                                      cache, _writable(cache), _exec_mount(cache)))
    return rows
