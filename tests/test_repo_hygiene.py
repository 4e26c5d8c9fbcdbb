"""The tree keeps its shape: parts depend one way (build -> contracts <- verify <- entrypoint,
families beside contracts, guard on contracts and families only), folders inside build/ and
entrypoint/ depend one way too (BUILD_LAYERS, ENTRYPOINT_LAYERS), no module or folder imports
itself round a cycle (a package __init__ that holds code counts as a module), no module grows past
400 lines, no folder past 15 modules, every folder's map (its README.md) names exactly its modules,
no two modules share a name without sharing a job, ruff passes, and plain `pytest` sees what
`python -m pytest` sees. The docs' copies of these tables are checked in test_docs_hygiene.py."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
PARTS = ("build", "contracts", "families", "verify", "entrypoint", "guard")
# who may import whom (besides itself); bench/ and tests/ may import anything
ALLOWED = {
    "contracts": set(),
    "families": {"contracts"},
    "build": {"contracts", "families", "guard"},   # guard: its .pth constants only
    "verify": {"contracts", "families"},
    "entrypoint": {"contracts", "families", "verify", "guard"},
    # the runtime guard runs inside trainers that are not ours: it may lean on nothing but the data
    "guard": {"contracts", "families"},
}


def modules(root: Path = REPO, parts: tuple[str, ...] = PARTS) -> dict[str, Path]:
    out = {}
    for part in parts:
        for path in sorted((root / part).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            names = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(names)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes inside `if TYPE_CHECKING:` blocks: names for annotations, never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skipped


def imports_of(path: Path, name: str, known: set[str], *, runtime_only: bool = False) -> set[str]:
    """Project modules imported by `path` (explicit import statements, at any depth; with
    runtime_only, not those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = _type_checking_only(tree) if runtime_only else set()
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` reaches the package itself only for names that are not its modules
            targets = [f"{base}.{a.name}" for a in node.names]
            if any(f"{base}.{a.name}" not in known for a in node.names):
                targets.append(base)
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(*, runtime_only: bool = False, root: Path = REPO, parts: tuple[str, ...] = PARTS) -> dict[str, set[str]]:
    mods = modules(root, parts)
    known = set(mods)
    return {name: imports_of(path, name, known, runtime_only=runtime_only) for name, path in mods.items()}


def holds_code(init: Path) -> bool:
    """A package __init__ that does more than re-export: anything but a docstring, imports,
    `__all__` and an `if TYPE_CHECKING:` block. Importing any of its submodules runs it first."""
    for stmt in ast.parse(init.read_text()).body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) \
            else []
        if targets and all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING":
            continue
        return True
    return False


def cycle_edges(*, root: Path = REPO, parts: tuple[str, ...] = PARTS) -> dict[str, set[str]]:
    """The module graph as Python runs it. A package whose __init__ holds code is a module like any
    other: importing `pkg.sub` from outside runs `pkg` first (an edge to it), and its own imports
    of its submodules are edges too. A package that only re-exports is passed over: an edge from it
    to its own submodule is not a cycle by itself."""
    mods = modules(root, parts)
    coded = {name for name, path in mods.items() if path.name == "__init__.py" and holds_code(path)}
    edges = graph(root=root, parts=parts)
    for name, targets in edges.items():
        implicit = set()
        for target in targets:
            pieces = target.split(".")
            for depth in range(1, len(pieces)):
                package = ".".join(pieces[:depth])
                if package in coded and not (name == package or name.startswith(package + ".")):
                    implicit.add(package)
        targets |= implicit
    for name in mods:
        if name not in coded and name in edges:
            edges[name] = {t for t in edges[name] if not t.startswith(name + ".")}
    return edges


def test_parts_depend_one_way():
    bad = []
    for name, targets in graph().items():
        part = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != part and other not in ALLOWED[part]:
                bad.append(f"{name} imports {target}")
    assert not bad, "\n".join(bad)


# Inside build/ and entrypoint/: what each folder (or module at the part's top) may import, other
# parts included, besides itself; taken from the imports a module needs to run (those under `if
# TYPE_CHECKING:` are annotations only; the cycle check counts them). The modules at a part's top
# that are not listed (build's pipeline, CLI and __main__; entrypoint's CLI, worker, trainer, step,
# loss, evaluate, schedule, pid1) sit above all of it. docs/architecture.md holds the same tables.
BUILD_LAYERS = {
    "audit": {"contracts", "engine", "errors", "families", "oci", "publish", "signing", "spec"},
    "base": {"cache", "context", "contracts", "engine", "errors", "oci", "proc", "remote_cache", "resolve",
             "source_date", "spec"},
    "cache": {"errors"},
    "context": {"cache", "contracts", "engine", "guard", "resolve", "source_date", "spec", "templating", "wheelhouse"},
    "engine": {"contracts", "errors"},
    "errors": {"contracts"},
    "kernels": {"cache", "context", "contracts", "engine", "errors", "proc", "resolve", "signing", "spec",
                "templating", "wheelhouse"},
    "oci": {"cache", "context", "contracts", "errors", "guard", "resolve", "source_date"},
    "proc": {"contracts"},
    "publish": {"build_report", "contracts", "engine", "errors", "oci", "resolve", "signing", "source_date", "spec"},
    "remote_cache": {"audit", "context", "contracts", "kernels", "oci", "publish", "resolve", "signing", "wheelhouse"},
    "build_report": set(),
    "resolve": {"contracts", "families", "spec"},
    "signing": {"errors"},
    "source_date": {"contracts", "spec"},
    "spec": {"contracts", "families"},
    "templating": set(),
    "wheelhouse": {"cache", "contracts", "errors", "proc", "resolve"},
}
ENTRYPOINT_LAYERS = {
    "observability": {"contracts"},
    "distributed": {"contracts", "families"},
    "data": {"contracts", "inputs", "verify"},
    "checkpoint": {"contracts", "distributed"},
    "launcher": {"checkpoint", "contracts", "data", "distributed", "info", "inputs", "model", "observability",
                 "verify"},
    "inputs": {"contracts"},
    "info": {"contracts"},
    "model": {"checkpoint", "contracts", "distributed", "families"},
}
LAYERS = {"build": BUILD_LAYERS, "entrypoint": ENTRYPOINT_LAYERS}


def layer_violations(edges: dict[str, set[str]], part: str, layers: dict[str, set[str]]) -> list[str]:
    """Imports of a listed folder (or module) of `part` that its row does not allow: another part
    is named by the part, a neighbour by its name inside `part`."""
    bad = []
    for name, targets in edges.items():
        pieces = name.split(".")
        if pieces[0] != part or len(pieces) < 2 or pieces[1] not in layers:
            continue
        for target in targets:
            tpieces = target.split(".")
            if target == part:
                continue    # the part's own __init__ (a docstring)
            room = tpieces[1] if tpieces[0] == part else tpieces[0]
            if room != pieces[1] and room not in layers[pieces[1]]:
                bad.append(f"{name} imports {target}")
    return bad


@pytest.mark.parametrize("part", sorted(LAYERS))
def test_folders_inside_a_part_depend_one_way(part):
    bad = layer_violations(graph(runtime_only=True), part, LAYERS[part])
    assert not bad, "\n".join(bad)


def test_every_folder_of_build_has_its_row():
    """A new folder or low-level module in build/ gets a row (or is one of the few above all)."""
    above = {"pipeline", "cli", "__main__"}
    rooms = {p.stem if p.suffix == ".py" else p.name for p in (REPO / "build").iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert rooms - above == set(BUILD_LAYERS), (rooms - above) ^ set(BUILD_LAYERS)


def folder_of(name: str) -> str:
    """A module's room: its part's subfolder (`build.kernels`, `entrypoint.data`), or itself when it
    sits at the top of its part (`entrypoint.trainer`)."""
    parts = name.split(".")
    if len(parts) >= 2 and (REPO / parts[0] / parts[1] / "__init__.py").is_file():
        return ".".join(parts[:2])
    return name


def find_cycles(edges: dict[str, set[str]], *, skip=lambda node, nxt: False) -> list[str]:
    """Every cycle a depth-first walk of `edges` meets, as "a -> b -> a"."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if skip(node, nxt):
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycles_between_folders():
    edges: dict[str, set[str]] = {}
    for name, targets in graph(runtime_only=True).items():
        here = folder_of(name)
        edges.setdefault(here, set()).update(folder_of(t) for t in targets if folder_of(t) != here
                                             and t.split(".")[0] == name.split(".")[0])
    cycles = find_cycles(edges)
    assert not cycles, "\n".join(cycles)


def test_no_import_cycles():
    cycles = find_cycles(cycle_edges())
    assert not cycles, "\n".join(cycles)


def test_the_cycle_check_sees_a_cycle_through_a_package_init_that_holds_code(tmp_path):
    """x -> q (an __init__ with code) -> q.opts -> x: the shape the build's pipeline ->
    remote_cache -> options -> push -> pipeline cycle had. Passing over every edge from a package
    to its own submodule misses it; counting the __init__ as a module finds it."""
    files = {"p/__init__.py": "",
             "p/x.py": "from p.q import thing\n",
             "p/q/__init__.py": "from p.q.opts import Options\n\n\ndef thing():\n    return Options()\n",
             "p/q/opts.py": "from p.x import something\n\n\nclass Options:\n    pass\n",
             "p/r/__init__.py": "from p.r.a import A\n\n__all__ = ['A']\n",   # a re-export: no cycle by itself
             "p/r/a.py": "from p.r.b import B\nA = B\n",
             "p/r/b.py": "B = 1\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    old_rule = find_cycles(graph(root=tmp_path, parts=("p",)), skip=lambda node, nxt: nxt.startswith(node + "."))
    assert old_rule == []
    assert find_cycles(cycle_edges(root=tmp_path, parts=("p",))) == ["p.q -> p.q.opts -> p.x -> p.q"]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def package_folders() -> list[Path]:
    return sorted(init.parent for part in PARTS for init in (REPO / part).rglob("__init__.py"))


def test_no_folder_holds_more_than_15_modules():
    crowded = {str(f.relative_to(REPO)): n for f in package_folders()
               if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > 15}
    assert not crowded, crowded


MAP_BULLET = re.compile(r"^- `([A-Za-z0-9_]+\.py|[A-Za-z0-9_]+/)`", re.M)


def test_every_folder_map_names_exactly_its_modules():
    """Each package folder's README.md has one `- `name.py`: ...` bullet per module (`__init__.py`
    aside) and one `- `sub/`: ...` per subpackage: none missing, none that no longer exists."""
    problems = []
    for folder in package_folders():
        rel = folder.relative_to(REPO)
        readme = folder / "README.md"
        if not readme.is_file():
            problems.append(f"{rel}/: no README.md (its map)")
            continue
        named = MAP_BULLET.findall(readme.read_text())
        have = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        have |= {f"{d.name}/" for d in folder.iterdir() if (d / "__init__.py").is_file()}
        if missing := sorted(have - set(named)):
            problems.append(f"{rel}/README.md leaves out {', '.join(missing)}")
        if stale := sorted(set(named) - have):
            problems.append(f"{rel}/README.md names {', '.join(stale)}, which {rel}/ does not have")
        if dupes := sorted({n for n in named if named.count(n) > 1}):
            problems.append(f"{rel}/README.md names {', '.join(dupes)} twice")
    assert not problems, "\n".join(problems)


def test_the_map_test_sees_a_stale_and_a_missing_module(tmp_path):
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "kept.py").write_text("")
    (folder / "new.py").write_text("")
    (folder / "README.md").write_text("# pkg\n\n- `kept.py`: here\n- `gone.py`: moved away\n")
    named = set(MAP_BULLET.findall((folder / "README.md").read_text()))
    have = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    assert have - named == {"new.py"} and named - have == {"gone.py"}


# Modules that share a name because they share a job: each part's command line and `-m` entry, and
# a part's own errors over the one base in contracts/errors.py.
SAME_JOB_NAMES = {"__init__.py", "__main__.py", "cli.py", "errors.py"}


def test_no_two_modules_share_a_name_without_sharing_a_job():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    by_name: dict[str, list[str]] = {}
    for path in tracked:
        if path.startswith("tests/") or not (REPO / path).is_file():
            continue
        by_name.setdefault(Path(path).name, []).append(path)
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SAME_JOB_NAMES}
    assert not shared, shared


UPSTREAM_DOCS = {"RELEASE.md"}   # cited as sources, with their project: PyTorch's release matrix


def test_no_project_code_cites_a_file_the_repo_does_not_have():
    """The project's docs stand alone: every document its code names is in the repo."""
    tracked = {Path(p).name for p in subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True,
                                                     text=True, check=True).stdout.split()}
    offenders = []
    for path in [*REPO.glob("*/**/*.py"), *REPO.glob("*/**/*.yaml"), *REPO.glob("*/**/*.j2"), *REPO.glob("*.yaml")]:
        if ".git" in path.parts or "tests" in path.parts:
            continue
        text = path.read_text(errors="replace")
        cited = set(re.findall(r"[\w.-]+\.md\b", text)) - tracked - UPSTREAM_DOCS
        outside = re.findall(r"\.\./\.\./|(?<![\w./])\.\./[A-Za-z]", text)
        if cited or outside:
            offenders.append(f"{path.relative_to(REPO)}: {sorted(cited) + outside}")
    assert not offenders, offenders


def test_ruff_passes_on_the_whole_tree_including_build():
    listed = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=REPO,
                            capture_output=True, text=True).stdout
    assert "build/cli/main.py" in listed and "build/spec/shapes.py" in listed   # ruff does see build/
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_plain_pytest_collects_what_python_m_pytest_collects():
    def collected(cmd):
        proc = subprocess.run([*cmd, "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/build",
                               "tests/verify"],
                              cwd=REPO, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                             "HOME": str(Path.home())})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return sorted(line for line in proc.stdout.splitlines() if "::" in line)

    pytest_bin = Path(sys.executable).with_name("pytest")
    plain = collected([str(pytest_bin)])
    module = collected([sys.executable, "-m", "pytest"])
    assert plain == module and len(plain) > 50


def test_a_hung_unit_or_training_test_fails_instead_of_holding_ci(request):
    """Every collected unit and training test carries a timeout (tests/conftest.py): a hang, such as
    a forked worker deadlocked on an inherited lock, fails that test with its stack."""
    from tests.conftest import TIMEOUTS

    items = request.session.items
    assert request.node in items
    for item in items:
        marker = item.get_closest_marker("timeout")
        tiers = [tier for tier in TIMEOUTS if item.get_closest_marker(tier)]
        if item.get_closest_marker("engine") or item.get_closest_marker("kernel"):
            assert marker is None, item.nodeid
        elif tiers:
            assert marker is not None and marker.args[0] == max(TIMEOUTS[t] for t in tiers), item.nodeid
