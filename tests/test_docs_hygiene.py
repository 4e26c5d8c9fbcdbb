"""The docs cannot go stale without a test failing:

- the import tables in docs/architecture.md equal the ones the layering tests enforce
  (test_repo_hygiene.py: ALLOWED, BUILD_LAYERS, ENTRYPOINT_LAYERS), and every folder README's
  "May import:" line agrees with them;
- every repository path a doc or README names (in backticks or as a link) exists;
- measured figures live in bench/RESULTS.md: no sha256 digest outside code blocks in README.md or
  docs/, and no number with a unit outside code blocks in README.md;
- the walk-throughs link a function that exists (checked with ast) for every phase `build_image`
  times and every step from `finetune`'s command line to the first optimizer step.
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.test_repo_hygiene import ALLOWED, BUILD_LAYERS, ENTRYPOINT_LAYERS, PARTS, REPO

pytestmark = pytest.mark.unit

ARCHITECTURE = REPO / "docs" / "architecture.md"
TABLES = {"parts": ALLOWED, "build": BUILD_LAYERS, "entrypoint": ENTRYPOINT_LAYERS}
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
BACKTICKED = re.compile(r"`([^`\n]+)`")


def outside_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def room_name(token: str, part: str = "") -> str:
    """`build/kernels/`, `kernels/`, `build.kernels`, `cache.py` -> the name the layer tables use."""
    name = token.strip().rstrip("/")
    for prefix in (f"{part}/", f"{part}.") if part else ():
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.removesuffix(".py").replace("/", ".")


def table_after(text: str, kind: str, part: str = "") -> dict[str, set[str]] | None:
    """The first markdown table after `<!-- may-import: KIND -->`, as {row: names it may import}."""
    marker = text.find(f"<!-- may-import: {kind} -->")
    if marker < 0:
        return None
    rows: dict[str, set[str]] = {}
    started = False
    for line in text[marker:].splitlines()[1:]:
        if not line.startswith("|"):
            if started:
                break
            continue
        started = True
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = BACKTICKED.findall(cells[0])
        if len(cells) < 2 or not names:
            continue   # the header and its rule
        rows[room_name(names[0], part)] = {room_name(n, part) for n in BACKTICKED.findall(cells[1])}
    return rows


def table_problems(text: str, kind: str, enforced: dict[str, set[str]]) -> list[str]:
    part = "" if kind == "parts" else kind
    table = table_after(text, kind, part)
    if table is None:
        return [f"no `<!-- may-import: {kind} -->` table"]
    problems = [f"{kind}: row {row!r} is missing" for row in sorted(set(enforced) - set(table))]
    problems += [f"{kind}: row {row!r} is not in the enforced table" for row in sorted(set(table) - set(enforced))]
    for row in sorted(set(table) & set(enforced)):
        if table[row] != enforced[row]:
            problems.append(f"{kind}: {row} may import {sorted(enforced[row])}, the doc says {sorted(table[row])}")
    return problems


def test_the_import_tables_in_the_architecture_doc_are_the_enforced_ones():
    text = ARCHITECTURE.read_text()
    problems = [p for kind, enforced in TABLES.items() for p in table_problems(text, kind, enforced)]
    assert not problems, "\n".join(problems)


def test_a_stale_import_table_fails():
    text = ARCHITECTURE.read_text()
    marker = text.index("<!-- may-import: parts -->")
    build_row = next(line for line in text[marker:].splitlines() if line.startswith("| `build/` |"))
    stale = text[:marker] + text[marker:].replace(build_row, build_row.replace(", `guard/`", ""), 1)
    assert table_problems(stale, "parts", ALLOWED) == [
        "parts: build may import ['contracts', 'families', 'guard'], the doc says ['contracts', 'families']"]
    extra = text.replace("| `cache.py` | `errors.py` |", "| `cache.py` | `errors.py` |\n| `gone.py` | nothing |")
    assert table_problems(extra, "build", BUILD_LAYERS) == ["build: row 'gone' is not in the enforced table"]
    assert table_problems("no tables here", "entrypoint", ENTRYPOINT_LAYERS) == [
        "no `<!-- may-import: entrypoint -->` table"]


MAY_IMPORT = re.compile(r"^May import:(.*?)(?:\.(?=\s|$)|\n\s*\n|\Z)", re.M | re.S)


def may_import(text: str, part: str) -> set[str] | None:
    """The names in a README's `May import:` sentence (None if it has none); what follows the
    sentence is commentary."""
    found = MAY_IMPORT.search(text)
    if found is None:
        return None
    return {room_name(name, part) for name in BACKTICKED.findall(found.group(1))}


def folder_readmes() -> dict[Path, set[str]]:
    """Each README that must state what its folder may import, with what the tables allow it."""
    readmes = {REPO / part / "README.md": ALLOWED[part] for part in PARTS}
    for part, layers in (("build", BUILD_LAYERS), ("entrypoint", ENTRYPOINT_LAYERS)):
        for room, allowed in layers.items():
            if (REPO / part / room / "README.md").is_file():
                readmes[REPO / part / room / "README.md"] = allowed
    return readmes


def test_each_folder_readme_says_what_the_tables_allow():
    problems = []
    for readme, allowed in folder_readmes().items():
        part = readme.relative_to(REPO).parts[0]
        named = may_import(readme.read_text(), part if readme.parent != REPO / part else "")
        rel = readme.relative_to(REPO)
        if named is None:
            problems.append(f"{rel}: no 'May import:' line")
        elif named != allowed:
            problems.append(f"{rel}: 'May import:' names {sorted(named)}, the tables allow {sorted(allowed)}")
    assert not problems, "\n".join(problems)


def test_a_may_import_line_that_names_too_much_fails():
    assert may_import("# x\n\nMay import: `contracts/`, `cache.py` and\n`build/errors.py`.\n\nMore.", "build") == \
        {"contracts", "cache", "errors"}
    assert may_import("May import: nothing of this project.\n", "") == set()
    assert may_import("Imports whatever it likes.\n", "") is None


# ---- paths ---------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH_TOKEN = re.compile(r"(?:\./)?[\w.-]+(?:/[\w.-]+)*/?")
SKIPPED_ROOTS = ("out/",)   # git-ignored: a build's output folder (it holds a copy of the app)


def docs_to_check() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    readmes = [REPO / p for p in tracked if Path(p).name == "README.md" and not p.startswith("tests/")]
    return sorted({*readmes, *(REPO / "docs").glob("*.md"), REPO / "bench" / "RESULTS.md"})


def missing_paths(doc: Path, text: str, root: Path = REPO) -> list[str]:
    """Repository paths `doc` names that do not exist: links (relative to the doc) and backticked
    paths (from the repository root when they start at a top-level entry, else from the doc's own
    folder when they start at one of its entries)."""
    top = {p.name for p in root.iterdir()}
    here = {p.name for p in doc.parent.iterdir()} if doc.parent.is_dir() else set()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if path and not (doc.parent / path).exists():
            missing.append(f"link {target}")
    for token in BACKTICKED.findall(outside_code_blocks(text)):
        if "/" not in token or not PATH_TOKEN.fullmatch(token) or token.startswith(SKIPPED_ROOTS):
            continue
        first = token.removeprefix("./").split("/")[0]
        if first in top:
            exists = (root / token).exists()
        elif first in here:
            exists = (doc.parent / token).exists()
        else:
            continue   # not a path of this repository (a folder in an image, on a host, upstream)
        if not exists:
            missing.append(f"`{token}`")
    return missing


def test_every_path_a_doc_names_exists():
    problems = []
    for doc in docs_to_check():
        for what in missing_paths(doc, doc.read_text()):
            problems.append(f"{doc.relative_to(REPO)} names {what}, which does not exist")
    assert not problems, "\n".join(problems)


def test_a_missing_path_fails(tmp_path):
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "kept.py").write_text("")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    text = ("See `build/kept.py`, `build/gone.py`, [a link](../build/kept.py), [stale](../build/old.py#x), "
            "`out/smoke/context/`, `/etc/docker/daemon.json` and\n```\nbuild/not-checked.py\n```\n")
    assert missing_paths(doc, text, tmp_path) == ["link ../build/old.py#x", "`build/gone.py`"]


# ---- figures -------------------------------------------------------------------------------------

DIGEST = re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{64}(?![0-9a-fA-F])")
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*\s?(?:s|min|h|GiB|MiB|KiB|GB|MB|KB|kB|x|×|%)(?![\w])")


def figures(text: str, *, units: bool) -> list[str]:
    prose = outside_code_blocks(text)
    found = DIGEST.findall(prose)
    return found + (FIGURE.findall(prose) if units else [])


def test_measured_figures_live_in_the_results_file():
    problems = [f"README.md: {f}" for f in figures((REPO / "README.md").read_text(), units=True)]
    for doc in sorted((REPO / "docs").glob("*.md")):
        problems += [f"{doc.relative_to(REPO)}: {f}" for f in figures(doc.read_text(), units=False)]
    assert not problems, "move these to bench/RESULTS.md (with the command, date and machine):\n" + \
        "\n".join(problems)


def test_a_figure_outside_a_code_block_fails():
    digest = "ab" * 32
    text = f"It took 26 min, 1.5x the pull, 80% of a core and 3.98 MB; image {digest}.\n```\n42 s {digest}\n```\n"
    assert figures(text, units=True) == [digest, "26 min", "1.5x", "80%", "3.98 MB"]
    assert figures("Python 3.11, sm_90, 2 cores, H100, 0x1f, torch 2.14.1\n", units=True) == []


# ---- walk-throughs ---------------------------------------------------------------------------------

FUNCTION_LINK = re.compile(r"\[`([A-Za-z_][\w.]*)`\]\(([^)#\s]+\.py)\)")
FINETUNE_STEPS = ("cli", "config", "verify", "inputs", "launch", "rank", "model", "data", "step")


def timed_phases() -> list[str]:
    """The phases `build_image` times (`with timer("...")`), in the order the pipeline names them."""
    tree = ast.parse((REPO / "build" / "pipeline.py").read_text())
    phases: list[str] = []
    calls = sorted((node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "timer" and node.args and isinstance(node.args[0], ast.Constant)),
                   key=lambda node: node.lineno)
    for call in calls:
        if call.args[0].value not in phases:
            phases.append(call.args[0].value)
    return phases


def defines(path: Path, name: str) -> bool:
    """`path` defines `name` at its top level, or `Class.method`."""
    if not path.is_file():
        return False
    body = ast.parse(path.read_text()).body
    head, _, rest = name.partition(".")
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == head:
            if not rest:
                return True
            return isinstance(node, ast.ClassDef) and any(
                isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner.name == rest
                for inner in node.body)
    return False


def sections(text: str) -> list[tuple[str, str]]:
    parts = re.split(r"^## ", text, flags=re.M)
    return [(chunk.split("\n", 1)[0], chunk.split("\n", 1)[1] if "\n" in chunk else "") for chunk in parts[1:]]


def walkthrough_problems(doc: Path, steps: tuple[str, ...] | list[str], text: str | None = None) -> list[str]:
    text = doc.read_text() if text is None else text
    problems = [f"[`{name}`]({target}): {target} does not define {name}"
                for name, target in FUNCTION_LINK.findall(text) if not defines(doc.parent / target, name)]
    found = sections(text)
    for step in steps:
        bodies = [body for heading, body in found if f"`{step}`" in heading]
        if not bodies:
            problems.append(f"no '## ' section for `{step}`")
        elif not any(defines(doc.parent / target, name) for body in bodies for name, target in
                     FUNCTION_LINK.findall(body)):
            problems.append(f"the `{step}` section links no function that exists")
    return problems


def test_the_build_walkthrough_links_a_function_for_every_timed_phase():
    phases = timed_phases()
    assert phases == ["engine", "bases", "wheelhouse", "kernels", "render", "image", "check", "prune"]
    problems = walkthrough_problems(REPO / "docs" / "build-process.md", phases)
    assert not problems, "\n".join(problems)


def test_the_finetune_walkthrough_links_a_function_for_every_step():
    problems = walkthrough_problems(REPO / "docs" / "finetune-process.md", FINETUNE_STEPS)
    assert not problems, "\n".join(problems)


def test_a_walkthrough_with_a_stale_link_or_a_missing_step_fails():
    doc = REPO / "docs" / "build-process.md"
    text = ("## 1. `engine`\n[`connect`](../build/engine/__init__.py)\n"
            "## 2. `bases`\n[`ensure_base`](../build/base/bootstrap.py) [`gone`](../build/pipeline.py)\n"
            "## 3. `render`\nno link\n")
    assert walkthrough_problems(doc, ["engine", "bases", "render", "prune"], text) == [
        "[`gone`](../build/pipeline.py): ../build/pipeline.py does not define gone",
        "the `render` section links no function that exists", "no '## ' section for `prune`"]
    assert defines(REPO / "build" / "pipeline.py", "PhaseTimer.__call__")
