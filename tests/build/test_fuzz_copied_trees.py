"""Hypothesis over the trees the build copies into an image: the app packages (links inside and
outside the tree, FIFOs, folders, files of every suffix and size) and a bases import folder
(links, wrong sizes, wrong bytes). Whatever the tree holds, the copy either refuses with the one
named error, or holds exactly the regular runtime files of the tree, byte for byte, and nothing
from outside it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.unit

EXAMPLES = 200
NAMES = st.sampled_from(["a.py", "b.yaml", "c.json", "d.txt", "e.so", "test_x.py", "conftest.py", "f.py"])
ENTRY = st.tuples(st.sampled_from(["", "sub", "sub/deep", "__pycache__"]), NAMES,
                  st.sampled_from(["file", "link_inside", "link_outside", "link_dir_outside", "fifo", "dir"]),
                  st.binary(max_size=64))


def _make_tree(root: Path, outside: Path, entries) -> None:
    (root).mkdir(parents=True)
    (root / "anchor.py").write_text("ANCHOR = 1\n")
    for folder, name, kind, data in entries:
        path = root / folder / name
        if path.exists() or path.is_symlink():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_bytes(data)
        elif kind == "link_inside":
            path.symlink_to(root / "anchor.py")
        elif kind == "link_outside":
            path.symlink_to(outside / "secret.yaml")
        elif kind == "link_dir_outside":
            path.symlink_to(outside, target_is_directory=True)
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()


def _leaves_tree(root: Path) -> bool:
    real_root = Path(os.path.realpath(root))
    for path in root.rglob("*"):
        if "__pycache__" in path.relative_to(root).parts:
            continue
        real = Path(os.path.realpath(path))
        if real != real_root and real_root not in real.parents:
            return True
    return False


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(ENTRY, max_size=10))
def test_fuzz_the_app_copy(entries):
    from build.context.render import APP_SUFFIXES, copy_app
    from contracts.folder_guard import UnsafeFolder

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        outside = tmp / "outside"
        outside.mkdir()
        (outside / "secret.yaml").write_text("token: do-not-ship\n")
        src, dest = tmp / "pkg", tmp / "copy"
        _make_tree(src, outside, entries)
        if _leaves_tree(src):
            with pytest.raises(UnsafeFolder):
                copy_app(src, dest)
            return
        copy_app(src, dest)
        expected = {}
        for path in src.rglob("*"):
            rel = path.relative_to(src)
            if ("__pycache__" in rel.parts or not path.is_file() or path.suffix not in APP_SUFFIXES
                    or path.name.startswith("test_") or path.name == "conftest.py"):
                continue
            expected[str(rel)] = path.read_bytes()
        got = {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()} \
            if dest.exists() else {}
        assert got == expected
        assert all(b"do-not-ship" not in data for data in got.values())
        shutil.rmtree(dest, ignore_errors=True)


DEB_CASE = st.sampled_from(["ok", "missing", "link", "short", "long", "other_bytes", "folder"])


@settings(max_examples=EXAMPLES, deadline=None)
@given(cases=st.tuples(DEB_CASE, DEB_CASE))
def test_fuzz_a_bases_import_folder(cases):
    from build.base import debs_lock
    from build.cache import CacheLayout
    from tests.build.test_debs_lock import make_lock

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        contents = {"base-files": b"one", "bash": b"two"}
        lock = make_lock(tmp / "mirror", "http://127.0.0.1:9/debian", contents)
        folder = tmp / "export"
        folder.mkdir()
        (tmp / "elsewhere.deb").write_bytes(b"two")
        for deb, case in zip(lock.debs, cases):
            path, data = folder / deb.basename, contents[deb.package]
            if case == "ok":
                path.write_bytes(data)
            elif case == "link":
                path.symlink_to(tmp / "elsewhere.deb")
            elif case == "short":
                path.write_bytes(data[:-1])
            elif case == "long":
                path.write_bytes(data + b"x")
            elif case == "other_bytes":
                path.write_bytes(bytes(len(data)))
            elif case == "folder":
                path.mkdir()
        cache = CacheLayout(tmp / "cache")
        refused = {"link", "short", "long", "other_bytes", "folder"} & set(cases)
        if refused:
            with pytest.raises(debs_lock.DebLockErrors):
                debs_lock.import_debs([lock], cache, folder)
        else:
            assert debs_lock.import_debs([lock], cache, folder) == cases.count("ok")
        for deb in lock.debs:   # the cache holds a locked .deb whole, or nothing for it
            stored = debs_lock.deb_path(cache, deb)
            assert not stored.exists() or stored.read_bytes() == contents[deb.package]
