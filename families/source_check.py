"""A family file checked against the modeling source of the installed transformers, read with
ast (nothing imported, so build/'s `--plan` can run it without torch).

Each fact a family states about its modeling module must be true there: the module file exists;
the config, causal-LM, token-mixer and experts classes are defined in it; each `fused[].wrapper`
is a function decorated with `use_kernel_func_from_hub_with_fallback("<function>", ...)` for the
function the family names; and that function takes the boundary kwarg, explicitly or through
`**kwargs` (which transformers forwards to the kernel it resolved). A family written for another
transformers release fails here, naming the fact, instead of failing at a user's first step.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class ModuleFacts:
    classes: frozenset[str]
    # wrapper name -> (the function name it is registered for, its explicit params, takes **kwargs)
    wrapped: dict[str, tuple[str, frozenset[str], bool]]
    experts: frozenset[str]      # classes decorated with @use_experts_implementation


def transformers_root() -> Path | None:
    """The installed transformers package folder, found without importing it."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


@cache
def module_facts(path: Path) -> ModuleFacts | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    classes, experts, wrapped = set(), set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes.add(node.name)
            if any(_decorator_name(d) == "use_experts_implementation" for d in node.decorator_list):
                experts.add(node.name)
        elif isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and _decorator_name(d) == "use_kernel_func_from_hub_with_fallback"
                        and d.args and isinstance(d.args[0], ast.Constant)):
                    a = node.args
                    params = frozenset(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)
                    wrapped[node.name] = (str(d.args[0].value), params, a.kwarg is not None)
    return ModuleFacts(frozenset(classes), wrapped, frozenset(experts))


def module_path(root: Path, modeling_module: str) -> Path:
    return root.joinpath(*modeling_module.split(".")[1:]).with_suffix(".py")


def problems(family, root: Path | None = None) -> list[tuple[str, str, str]]:
    """(field, problem, fix) for each family fact the installed transformers contradicts; none
    when transformers is not installed here (build/ on a host without it)."""
    root = root if root is not None else transformers_root()
    if root is None:
        return []
    version = transformers_version() or "installed"
    path = module_path(root, family.modeling_module)
    facts = module_facts(path) if path.is_file() else None
    if facts is None:
        return [("modeling_module", f"{family.modeling_module} is not in transformers {version} ({path} "
                 "is missing or unreadable)", "name the modeling module of the pinned transformers, e.g. "
                 "transformers.models.qwen3_5.modeling_qwen3_5")]
    found = []
    for field in ("config_class", "causal_lm_class"):
        name = getattr(family, field)
        if name not in facts.classes and not _imported(path, name):
            found.append((field, f"{name} is not defined in {family.modeling_module} (transformers {version})",
                          f"name a class of {family.modeling_module}"))
    for kind_name, kind in family.layer_kinds.items():
        if kind.layer_class not in facts.classes:
            found.append((f"layer_kinds.{kind_name}.layer_class", f"{kind.layer_class} is not a class of "
                          f"{family.modeling_module} (transformers {version})",
                          "name the token mixer's class the decoder layer builds for this kind"))
        for i, fused in enumerate(kind.fused):
            where = f"layer_kinds.{kind_name}.fused[{i}]"
            entry = facts.wrapped.get(fused.wrapper)
            if entry is None:
                found.append((f"{where}.wrapper", f"{fused.wrapper} is not a function of {family.modeling_module} "
                              "wrapped with use_kernel_func_from_hub_with_fallback", "name the wrapped function "
                              "the token mixer calls (grep use_kernel_func_from_hub_with_fallback in the module)"))
                continue
            registered, params, takes_kwargs = entry
            if registered != fused.function:
                found.append((f"{where}.function", f"{fused.wrapper} is registered for {registered!r}, not "
                              f"{fused.function!r}", f"set function: {registered}"))
            if fused.boundary_kwarg not in params and not takes_kwargs:
                found.append((f"{where}.boundary_kwarg", f"{fused.wrapper} takes no `{fused.boundary_kwarg}` "
                              f"(its parameters: {', '.join(sorted(params))}), so boundaries cannot reach the kernel",
                              "name the kwarg the kernel takes that this function passes through"))
    if family.experts is not None and family.experts.layer_class not in facts.experts:
        found.append(("experts.layer_class", f"{family.experts.layer_class} is not a class of "
                      f"{family.modeling_module} decorated with @use_experts_implementation",
                      "name the experts class transformers picks an implementation for"))
    return found


def _imported(path: Path, name: str) -> bool:
    """A class the modeling module imports (a config class lives in configuration_<model>.py)."""
    sibling = path.with_name(path.name.replace("modeling_", "configuration_", 1))
    facts = module_facts(sibling) if sibling.is_file() else None
    return bool(facts and name in facts.classes)
