"""GPU-free soundness checks that run INSIDE a container (builder or built image).

Standalone on purpose: it is sent into the container as `python -c`, so it may import
only the standard library and what the image itself holds (torch, the kernels).
Input: one JSON argument. Output: one JSON line of result rows on stdout.
"""
import importlib
import importlib.metadata as md
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile


def row(subject, check, ok, detail, fix=""):
    return {"subject": subject, "check": check, "status": "PASS" if ok else "FAIL", "detail": detail,
            "fix": "" if ok else fix}


def check_lock(cfg, rows):
    path = os.environ.get("FTIMAGE_LOCK", "/etc/ftimage/build.lock.json")
    try:
        with open(path) as fh:
            lock = json.load(fh)
    except (OSError, ValueError) as exc:
        rows.append(row("image", "lock", False, f"cannot read {path}: {exc}", "rebuild the image"))
        return None
    ok = lock.get("plan_key") == cfg["plan_key"]
    rows.append(row("image", "lock", ok, f"{path} plan {str(lock.get('plan_key'))[:12]}",
                    "the image holds a different lock than its plan; rebuild it"))
    missing = []
    # each kernel wheel is checked by the distribution it installs (fla ships as two)
    kernels = [{"name": k.get("distribution", k["name"]), "version": k["version"]} for k in lock.get("kernels", [])]
    for pkg in lock.get("packages", []) + kernels:
        try:
            have = md.version(pkg["name"])
        except md.PackageNotFoundError:
            missing.append(f"{pkg['name']} (absent)")
            continue
        if have != pkg["version"]:
            missing.append(f"{pkg['name']} {have} != {pkg['version']}")
    rows.append(row("image", "lock entries installed", not missing,
                    f"{len(lock.get('packages', []))} packages match" if not missing else "; ".join(missing[:5]),
                    "rebuild the image; its venv does not match its lock"))
    return lock


def check_torch(cfg, rows):
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        rows.append(row("torch", "import", False, f"{type(exc).__name__}: {exc}", "the image's torch is broken"))
        return
    want = cfg["torch"]
    ok = torch.__version__ == want or torch.__version__.split("+")[0] == want.split("+")[0] and \
        ("+" not in want or torch.__version__ == want)
    rows.append(row("torch", "version", ok, f"torch {torch.__version__} (lock {want})",
                    "install the torch wheel the lock pins"))
    cuda = torch.version.cuda
    if cfg["cuda"] == "cpu":
        rows.append(row("torch", "cuda build", cuda is None, f"torch.version.cuda={cuda}", "use the CPU torch wheel"))
    else:
        ok = cuda is not None and ".".join(cuda.split(".")[:2]) == cfg["cuda"]
        rows.append(row("torch", "cuda build", ok, f"torch.version.cuda={cuda} (lock {cfg['cuda']})",
                        "install the torch wheel built for the lock's CUDA"))
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    rows.append(row("torch", "cxx11 abi", abi == cfg["cxx11_abi"], f"_GLIBCXX_USE_CXX11_ABI={abi}",
                    "pin a torch built with the toolchain's C++ ABI"))


def check_extension(kernel, rows):
    name = kernel["name"]
    module_name = kernel["extension_module"]
    try:
        import torch  # noqa: F401 - extensions resolve symbols against the already-loaded torch
        module = importlib.import_module(module_name)
    except ImportError as exc:
        text = str(exc)
        symbol = re.search(r"undefined symbol: (\S+)", text)
        detail = f"undefined symbol {symbol.group(1)}" if symbol else text
        rows.append(row(name, "import/ABI", False, f"import {module_name}: {detail}",
                        "the wheel was built against a different torch/ABI: rebuild it with this toolchain "
                        "(its cache key includes the torch wheel sha256)"))
        return
    rows.append(row(name, "import/ABI", True, f"{module_name} from {os.path.basename(module.__file__)}"))
    for direction in ("forward", "backward", "other"):
        wanted = kernel["entry_points"].get(direction, [])
        missing = [e for e in wanted if not hasattr(module, e)]
        if wanted:
            rows.append(row(name, f"entry points ({direction})", not missing,
                            ", ".join(wanted) if not missing else f"missing: {', '.join(missing)}",
                            f"the manifest lists symbols {module_name} does not export; fix the manifest or the "
                            "kernel version"))


def module_source(module_name):
    """(the source file of a dotted module, "") or (None, why), without importing anything:
    find_spec("a.b") imports the package `a`, and importing fla or mamba_ssm initialises Triton's
    GPU driver (absent on a GPU-free build host) and imports their own dependencies (absent from
    a builder). Only the top-level package is looked up; its submodules are found on disk."""
    import importlib.util
    top, *rest = module_name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if spec is None:
        return None, "module not found"
    origin, folders = spec.origin, list(spec.submodule_search_locations or [])   # a namespace package: no origin
    for part in rest:
        for folder in folders:
            package, module = os.path.join(folder, part, "__init__.py"), os.path.join(folder, part + ".py")
            if os.path.isfile(package):
                origin, folders = package, [os.path.join(folder, part)]
                break
            if os.path.isfile(module):
                origin, folders = module, []
                break
        else:
            return None, "module not found"
    if not origin or not os.path.isfile(origin):
        return None, "module not found"
    return origin, ""


def check_python_entry_points(kernel, rows):
    """Find each entry point in the package's source without importing it (module_source)."""
    import ast
    name = kernel["name"]
    for direction in ("forward", "backward", "other"):
        for target in kernel["entry_points"].get(direction, []):
            module_name, _, attr = target.partition(":")
            origin, error = module_source(module_name)
            if origin is None:
                rows.append(row(name, f"entry point ({direction})", False, f"{target}: {error}",
                                "install the pinned version of the package"))
                continue
            with open(origin) as fh:
                tree = ast.parse(fh.read())
            scope, found = tree.body, True
            for part in attr.split("."):
                match = [n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part]
                if not match:
                    found = False
                    break
                scope = match[0].body
            rows.append(row(name, f"entry point ({direction})", found, target if found else f"{target}: not defined",
                            "the manifest names a symbol this version does not define; fix the manifest"))


def check_triton_runtime(kernel, rows):
    name = kernel["name"]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    rows.append(row(name, "triton: C compiler", bool(cc), cc or "no cc/gcc/clang on PATH",
                    "keep gcc in the runtime image: Triton builds its launcher stub with it at first use"))
    include = sysconfig.get_paths().get("include", "")
    header = os.path.join(include, "Python.h")
    rows.append(row(name, "triton: Python.h", os.path.isfile(header), header,
                    "install python3-dev in the runtime image"))
    cache_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir):
            pass
        rows.append(row(name, "triton: writable cache", True, cache_dir))
    except OSError as exc:
        rows.append(row(name, "triton: writable cache", False, f"{cache_dir}: {exc}",
                        "set TRITON_CACHE_DIR to a directory the runtime user owns"))
    try:
        have = md.version("triton")
        wanted = [r for r in (md.requires("torch") or []) if r.startswith("triton")]
        spec = wanted[0].split(";")[0].strip() if wanted else ""
        ok = True
        if spec:
            from packaging.requirements import Requirement  # vendored by pip-less images? fall back below
            ok = Requirement(spec).specifier.contains(have, prereleases=True)
        rows.append(row(name, "triton: version", ok, f"triton {have}; torch wants {spec or 'any'}",
                        "install the triton version torch declares"))
    except md.PackageNotFoundError:
        rows.append(row(name, "triton: version", False, "triton is not installed", "install the triton torch wants"))
    except ImportError:
        rows.append(row(name, "triton: version", True, f"triton {have} (packaging unavailable to compare)"))


def main(cfg):
    rows = []
    if cfg.get("check_lock", True):
        check_lock(cfg, rows)
    if not cfg.get("skip_torch"):
        check_torch(cfg, rows)
    for kernel in cfg.get("kernels", []):
        if kernel["kind"] == "cuda-extension":
            check_extension(kernel, rows)
        else:
            check_triton_runtime(kernel, rows)
            check_python_entry_points(kernel, rows)
    return rows


if __name__ == "__main__":
    print("FTIMAGE-CHECK " + json.dumps(main(json.loads(sys.argv[1]))))
