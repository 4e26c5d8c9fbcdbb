"""The tree keeps its shape: parts depend one way (build -> contracts <- verify <- entrypoint,
families beside contracts, guard on contracts and families only), no module imports itself round
a cycle, no module grows past 400 lines, ruff passes, and plain `pytest` sees what `python -m
pytest` sees."""
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
    "build": {"contracts", "families"},
    "verify": {"contracts", "families"},
    "entrypoint": {"contracts", "families", "verify", "guard"},
    # the runtime guard runs inside trainers that are not ours: it may lean on nothing but the data
    "guard": {"contracts", "families"},
}


def modules() -> dict[str, Path]:
    out = {}
    for part in PARTS:
        for path in sorted((REPO / part).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules imported by `path` (explicit import statements, at any depth)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def test_parts_depend_one_way():
    bad = []
    for name, targets in graph().items():
        part = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != part and other not in ALLOWED[part]:
                bad.append(f"{name} imports {target}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = graph()
    # package __init__ modules re-export their submodules; an edge from a submodule back to its
    # own package's __init__ is what makes a cycle, so keep every edge
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt.startswith(node + "."):
                continue  # a package importing its own submodule is not a cycle by itself
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def test_no_module_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


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
    assert "build/cli.py" in listed and "build/spec/schema.py" in listed   # ruff does see build/
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_plain_pytest_collects_what_python_m_pytest_collects():
    def collected(cmd):
        proc = subprocess.run([*cmd, "--collect-only", "-q", "-p", "no:cacheprovider", "tests/build", "tests/verify"],
                              cwd=REPO, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                             "HOME": str(Path.home())})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return sorted(line for line in proc.stdout.splitlines() if "::" in line)

    pytest_bin = Path(sys.executable).with_name("pytest")
    plain = collected([str(pytest_bin)])
    module = collected([sys.executable, "-m", "pytest"])
    assert plain == module and len(plain) > 50
