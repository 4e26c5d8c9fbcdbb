"""One rule for links in data paths, in every form data.path takes (a file, a folder, a glob, a
dataset folder's split, a save_to_disk folder, a mixture source, the eval split): no file is read
through a link that leaves the root the field names, and the refusal names the link. Links that
stay inside are followed; the named path itself may be a link."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entrypoint.data.linked_files import glob_root
from entrypoint.data.sources import DataError, resolve
from tests.fixtures.chat import run_entrypoint

pytestmark = pytest.mark.unit
ROW = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


def dataset_with_a_shard_linked_out(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset folder as the Hub lays out a split in shards, whose second shard is a link to a
    file outside the folder (the folder, the outside file)."""
    root = tmp_path / "ds"
    (root / "data").mkdir(parents=True)
    (root / "data" / "train-00000-of-00002.jsonl").write_text(ROW + "\n")
    secret = tmp_path / "elsewhere" / "secret.jsonl"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"messages": [{"role": "user", "content": "SECRET"},
                                               {"role": "assistant", "content": "SECRET"}]}) + "\n")
    os.symlink(secret, root / "data" / "train-00001-of-00002.jsonl")
    return root, secret


@pytest.mark.parametrize("split", ["", "train"])
def test_a_shard_linked_out_of_the_folder_is_refused_with_or_without_a_split(tmp_path, split):
    root, _ = dataset_with_a_shard_linked_out(tmp_path)
    with pytest.raises(DataError) as info:
        resolve(str(root), split=split)
    message = str(info.value)
    assert "train-00001-of-00002.jsonl is a link to" in message and "outside" in message, message
    assert info.value.field == "data.path" and "cp -rL" in info.value.fix


def test_a_glob_that_reaches_a_linked_folder_outside_is_refused_naming_the_folder_link(tmp_path):
    root = tmp_path / "globbed"
    (root / "mine").mkdir(parents=True)
    (root / "mine" / "a.jsonl").write_text(ROW + "\n")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "b.jsonl").write_text(ROW + "\n")
    os.symlink(tmp_path / "theirs", root / "linked")
    for pattern in (f"{root}/*/*.jsonl", f"{root}/**/*.jsonl"):
        with pytest.raises(DataError, match=rf"{root / 'linked'} is a link to {tmp_path / 'theirs'}"):
            resolve(pattern)


@pytest.mark.parametrize("form", ["mixture", "eval", "disk"])
def test_every_other_form_obeys_the_same_rule(tmp_path, form):
    root, _ = dataset_with_a_shard_linked_out(tmp_path)
    if form == "disk":
        (root / "dataset_info.json").write_text("{}")
    field = {"mixture": "data.sources[1].path", "eval": "data.eval_path", "disk": "data.path"}[form]
    with pytest.raises(DataError) as info:
        resolve(str(root), field=field)
    assert info.value.field == field and "is a link to" in str(info.value)


def test_links_that_stay_inside_are_followed_and_the_named_path_may_be_a_link(tmp_path):
    real = tmp_path / "real"
    (real / "data").mkdir(parents=True)
    (real / "data" / "a.jsonl").write_text(ROW + "\n")
    os.symlink(real / "data" / "a.jsonl", real / "b.jsonl")          # a file link inside
    os.symlink(real / "data", real / "also")                          # a folder link inside
    os.symlink(real / "also", real / "data" / "loop")                 # a loop: walked once
    os.symlink(real, tmp_path / "named")                              # the named path itself
    files = resolve(str(tmp_path / "named")).files
    named = tmp_path / "named"
    # one real folder is read once (`also` and `data` are the same folder; the loop is not followed)
    assert files == (str(named / "also" / "a.jsonl"), str(named / "b.jsonl"))
    assert {os.path.realpath(f) for f in files} == {str(real / "data" / "a.jsonl")}
    assert resolve(str(tmp_path / "named" / "b.jsonl")).files == (str(tmp_path / "named" / "b.jsonl"),)


def test_a_dangling_link_among_the_data_files_is_refused(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    (root / "a.jsonl").write_text(ROW + "\n")
    os.symlink(tmp_path / "gone.jsonl", root / "b.jsonl")
    with pytest.raises(DataError, match="which does not exist"):
        resolve(str(root))


def test_inspect_data_refuses_the_folder_and_prints_nothing_from_outside(fixture_dir, tmp_path):
    """The instance as a user meets it: `inspect-data` on the folder, no split given."""
    root, _ = dataset_with_a_shard_linked_out(tmp_path)
    proc = run_entrypoint(["inspect-data", "--config", str(fixture_dir.config), f"data.path={root}", "--rows", "4",
                           "--json"], timeout=240)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is a link to" in proc.stderr and "SECRET" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_glob_root_is_its_literal_prefix():
    assert glob_root("/data/*/train.jsonl") == Path("/data")
    assert glob_root("/data/x/**/*.jsonl") == Path("/data/x")
    assert glob_root("*.jsonl") == Path(".")


# ---- the rule, fuzzed over trees of files and links, in every form ---------------------------------------

ENTRY = st.sampled_from(["file", "link_in", "link_out", "dangling", "dir_in", "dir_out"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(ENTRY, min_size=1, max_size=6), form=st.sampled_from(["folder", "glob", "deep_glob",
                                                                            "split", "file"]))
def test_no_form_ever_reads_a_file_outside_the_named_root(tmp_path_factory, entries, form):
    base = tmp_path_factory.mktemp("tree")
    root, outside = base / "root", base / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "train-x.jsonl").write_text(ROW + "\n")
    (root / "train-00000-of-00001.jsonl").write_text(ROW + "\n")     # always one real file
    leaves = False
    for i, kind in enumerate(entries):
        name = root / "sub" / f"train-{i:05d}-of-00009.jsonl"
        if kind == "file":
            name.write_text(ROW + "\n")
        elif kind == "link_in":
            os.symlink(root / "train-00000-of-00001.jsonl", name)
        elif kind == "link_out":
            os.symlink(outside / "train-x.jsonl", name)
            leaves = True
        elif kind == "dangling":
            os.symlink(base / "nothing.jsonl", name)
            leaves = True
        elif kind == "dir_in":
            os.symlink(root / "sub", root / f"d{i}") if not (root / f"d{i}").exists() else None
        elif kind == "dir_out":
            os.symlink(outside, root / f"d{i}")
            leaves = True
    target = {"folder": str(root), "glob": f"{root}/*/*.jsonl", "deep_glob": f"{root}/**/*.jsonl",
              "split": str(root), "file": str(root / "train-00000-of-00001.jsonl")}[form]
    try:
        files = resolve(target, split="train" if form == "split" else "").files
    except DataError as exc:
        message = str(exc)
        assert "is a link to" in message or "no such split" in message or "matches no file" in message, message
        if "is a link to" in message:
            named = Path(message.split(": ", 1)[1].split(" is a link to")[0])
            assert named.is_symlink(), message
        return
    real_root = os.path.realpath(root)
    assert all(os.path.realpath(f).startswith(real_root + os.sep) for f in files), files
    if form == "folder":
        assert not leaves, f"a link out or a dangling link in {entries} was not refused"


def test_a_link_that_cannot_be_resolved_is_refused_not_a_traceback(tmp_path, monkeypatch):
    """/proc/<pid>/cwd of another process is a link even root may not read: one clear refusal."""
    import entrypoint.data.linked_files as linked

    root = tmp_path / "ds"
    root.mkdir()
    (root / "a.jsonl").write_text(ROW + "\n")
    os.symlink(tmp_path / "somewhere", root / "b.jsonl")
    real_readlink = os.readlink

    def denied(path, *args, **kwargs):
        if str(path).endswith("b.jsonl"):
            raise PermissionError(13, "Permission denied")
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(linked.os, "readlink", denied)
    with pytest.raises(DataError, match=r"b.jsonl cannot be resolved \(Permission denied\)"):
        resolve(str(root))
