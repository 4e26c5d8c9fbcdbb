"""What transformers bound for a family's fused functions, read without calling them, and why a
kernel package fell back (the real exception).

transformers 5.x wraps causal_conv1d_fn and chunk_gated_delta_rule with
use_kernel_func_from_hub_with_fallback (integrations/hub_kernels.py): it tries the installed
package ONCE, at import, inside `except Exception`, and falls back to the torch reference
silently; its only warning claims the package "is not installed" even when the import failed for
another reason. The wrapper's closure holds the answer (`implementation`, `is_new_implementation`,
`applicable_params`), and re-importing the package ourselves gives the real reason.

verify's dispatch check and the runtime guard both read it here. No torch import: inspect and
importlib only.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

# transformers' own map from a function to where it lives inside its package
# (_KERNELS_INTERNAL_PATH_MAPPINGS) and from a package to its distribution (_PACKAGE_TO_DISTRIBUTION)
# are read at call time, so the symbol named in a message is the one transformers tried.


@dataclass(frozen=True)
class Resolution:
    """What transformers' wrapper closed over for one function."""

    wrapper: str
    implementation: Callable | None = None
    torch_function: Callable | None = None
    is_new: bool = False
    applicable_params: tuple[str, ...] = ()
    package: str = ""          # the package transformers tried to import, e.g. "fla"
    func_name: str = ""        # the name transformers looked up in it, e.g. "chunk_gated_delta_rule"
    error: str = ""            # set when the closure could not be read

    @property
    def readable(self) -> bool:
        return not self.error


def describe(func: Callable | None) -> str:
    if func is None:
        return "nothing"
    try:
        inner = inspect.unwrap(func)
    except ValueError:  # a __wrapped__ cycle
        inner = func
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"


def _closure(func: Callable) -> dict:
    """The nonlocals of transformers' wrapper. A wrapper put around it (the runtime guard's, which
    sets __wrapped__ and closes over no `implementation`) is looked through; transformers' own
    wrapper stops the walk, since its __wrapped__ is the torch function."""
    seen = 0
    while func is not None and seen < 8:
        nonlocals = inspect.getclosurevars(func).nonlocals
        if "implementation" in nonlocals or not hasattr(func, "__wrapped__"):
            return nonlocals
        func, seen = func.__wrapped__, seen + 1
    return {}


def read_resolution(module, wrapper: str) -> Resolution:
    """Read `implementation` / `is_new_implementation` from the wrapper's closure (no calls made)."""
    func = getattr(module, wrapper, None)
    if func is None:
        return Resolution(wrapper, error=f"{module.__name__} has no {wrapper}")
    try:
        nonlocals = _closure(func)
    except TypeError as exc:
        return Resolution(wrapper, error=f"cannot inspect {wrapper}: {exc}")
    if "implementation" not in nonlocals or "is_new_implementation" not in nonlocals:
        return Resolution(
            wrapper,
            error=f"{wrapper} does not close over implementation/is_new_implementation; "
                  "transformers changed use_kernel_func_from_hub_with_fallback",
        )
    return Resolution(
        wrapper,
        implementation=nonlocals["implementation"],
        torch_function=nonlocals.get("torch_function"),
        is_new=bool(nonlocals["is_new_implementation"]),
        applicable_params=tuple(nonlocals.get("applicable_params", ())),
        package=str(nonlocals.get("package", "")),
        func_name=str(nonlocals.get("func_name", "")),
    )


def transformers_symbol(res: Resolution) -> tuple[str, str]:
    """(symbol, distribution) transformers tried for a resolution, e.g.
    ("fla.ops.gated_delta_rule.chunk_gated_delta_rule", "flash-linear-attention")."""
    try:   # transformers may be absent: verify imports this module before it checks REQUIRES
        from transformers.integrations import hub_kernels
        paths = getattr(hub_kernels, "_KERNELS_INTERNAL_PATH_MAPPINGS", {})
        distributions = getattr(hub_kernels, "_PACKAGE_TO_DISTRIBUTION", {})
    except ImportError:
        paths, distributions = {}, {}
    name = res.func_name or res.wrapper
    inner = paths.get(name)
    symbol = f"{res.package}.{inner}.{name}" if inner else f"{res.package}.{name}"
    return symbol, distributions.get(res.package, res.package)


def explain_fallback(package: str, symbol: str, distribution: str) -> str:
    """Re-import the package ourselves and say the REAL reason it is unusable.

    transformers' warning says "not installed" whatever happened; an undefined symbol, a Triton
    without a C compiler or a missing libcuda look the same there.
    """
    try:
        installed = f"{distribution} {importlib.metadata.version(distribution)} is installed"
    except importlib.metadata.PackageNotFoundError:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        installed = (f"`{package}` is present at {spec.origin or spec.submodule_search_locations}"
                     if spec is not None else f"`{package}` is not installed")
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name == package:
            return f"{installed} (ModuleNotFoundError: {exc})"
        return f"{installed} but `import {package}` raises ModuleNotFoundError: {exc} (a missing dependency)"
    except BaseException as exc:  # noqa: BLE001 - any failure is the answer we report
        return f"{installed} but `import {package}` raises {type(exc).__name__}: {exc}"
    module_path, _, name = symbol.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_path), name)
    except BaseException as exc:  # noqa: BLE001
        return f"`import {package}` works but `{symbol}` does not resolve: {type(exc).__name__}: {exc}"
    return (f"`{symbol}` imports now ({describe(found)}), yet transformers resolved the torch path at its "
            "import: the package was installed or fixed after transformers was imported, or it failed then")
