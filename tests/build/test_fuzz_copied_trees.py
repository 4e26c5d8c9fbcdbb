"""Hypothesis over the trees the build copies into an image: the app packages (links inside and
outside the tree, FIFOs, folders, files of every suffix and size), a bases import folder, the
wheelhouse placed from the cache, and the patches staged for a compile (for each: several files
of any bytes, links inside, outside and dangling, wrong sizes, other bytes at the same size,
FIFOs, folders, extra files). Whatever the tree holds, the copy either refuses with the one named
error, or holds exactly the regular files it should, byte for byte, and nothing from outside it."""
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


LINKS = ("link_outside", "link_inside", "link_dangling")


def _plant(path: Path, case: str, data: bytes, *, outside: Path, inside: Path) -> None:
    """Put at `path` what `case` names, standing in for a file whose pinned bytes are `data`. The
    links point to files holding exactly `data`: a link is refused for being one, not for its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if case in ("ok", "short", "long", "other_bytes"):
        path.write_bytes({"ok": data, "short": data[:-1], "long": data + b"x",
                          "other_bytes": bytes(b ^ 0xFF for b in data)}[case])
    elif case in ("link_outside", "link_inside"):
        target = outside if case == "link_outside" else inside
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        path.symlink_to(target)
    elif case == "link_dangling":
        path.symlink_to(path.parent / "nowhere")
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "folder":
        path.mkdir()


DEB_CASE = st.sampled_from(["ok", "missing", *LINKS, "short", "long", "other_bytes", "folder", "fifo"])
EXTRA = st.sampled_from(["evil_1.0_amd64.deb", "debs-manifest.json", "sub/pkg0_1.0_amd64.deb", ".hidden.deb"])


@settings(max_examples=EXAMPLES, deadline=None)
@given(debs=st.lists(st.tuples(st.binary(min_size=1, max_size=48), DEB_CASE), min_size=1, max_size=4),
       extras=st.lists(st.tuples(EXTRA, st.binary(max_size=16)), max_size=3))
def test_fuzz_a_bases_import_folder(debs, extras):
    from build.base import debs_lock
    from build.cache import CacheLayout
    from tests.build.test_debs_lock import make_lock

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        contents = {f"pkg{i}": data for i, (data, _case) in enumerate(debs)}
        lock = make_lock(tmp / "mirror", "http://127.0.0.1:9/debian", contents)
        folder = tmp / "export"
        folder.mkdir()
        for i, (deb, (data, case)) in enumerate(zip(lock.debs, debs, strict=True)):
            _plant(folder / deb.basename, case, data, outside=tmp / f"elsewhere-{i}.deb",
                   inside=folder / f"copy-{i}.bin")
        for name, data in extras:
            if not (folder / name).exists():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_bytes(data)
        cache = CacheLayout(tmp / "cache")
        cases = [case for _data, case in debs]
        if set(cases) - {"ok", "missing"}:
            with pytest.raises(debs_lock.DebLockErrors):
                debs_lock.import_debs([lock], cache, folder)
        else:
            assert debs_lock.import_debs([lock], cache, folder) == cases.count("ok")
        stored = sorted(p for p in (tmp / "cache").rglob("*") if p.is_file()) if (tmp / "cache").exists() else []
        locked = {debs_lock.deb_path(cache, deb): contents[deb.package] for deb in lock.debs}
        for path in stored:   # the cache holds a locked .deb whole, or nothing for it; never an extra
            assert path in locked and path.read_bytes() == locked[path]


WHEEL_CASE = st.sampled_from(["ok", "missing", *LINKS, "short", "long", "other_bytes", "folder", "fifo"])


@settings(max_examples=EXAMPLES, deadline=None)
@given(wheels=st.lists(st.tuples(st.binary(min_size=1, max_size=48), WHEEL_CASE), min_size=1, max_size=4))
def test_fuzz_the_wheelhouse_placement(wheels):
    """The cached wheels a build places: each is placed as the file itself of its recorded size,
    or refused naming it; the resolver's check before a hit evicts every damaged one (other bytes
    too), refuses a link out of the cache by name, and never reads what a link points to."""
    import hashlib
    import io

    from build.cache import CacheLayout, UnsafeFile, link_or_copy
    from build.wheelhouse import Wheel, verify_cached_wheels
    from contracts.events import EventLog

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = CacheLayout(tmp / "cache")
        planted = []
        for i, (data, case) in enumerate(wheels):
            data = bytes([i]) + data     # one sha256 folder per wheel: evicting one never takes another
            wheel = Wheel(name=f"pkg{i}", version="1.0", filename=f"pkg{i}-1.0-py3-none-any.whl",
                          sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            path = cache.wheel_path(wheel.sha256, wheel.filename)
            _plant(path, case, data, outside=tmp / "outside" / f"{i}.whl", inside=cache.wheels / f"stray-{i}.whl")
            planted.append((wheel, case, path, data))
        house = tmp / "wheelhouse"
        for wheel, case, path, _data in planted:
            placed = house / wheel.filename
            try:
                link_or_copy(path, placed, size=wheel.size)
            except UnsafeFile as exc:
                assert case not in ("ok", "other_bytes") and str(path) in str(exc) and str(path.parent) in exc.fix
                assert not placed.exists() and not placed.is_symlink()
            else:
                assert case in ("ok", "other_bytes")     # the bytes are the resolver's check, below
                assert not placed.is_symlink() and placed.read_bytes() == path.read_bytes()
                assert placed.stat().st_size == wheel.size
        log = io.StringIO()
        cases = [case for _wheel, case, _path, _data in planted]
        records = tuple(w for w, *_ in planted)
        if "link_outside" in cases:
            with pytest.raises(UnsafeFile) as refused:
                verify_cached_wheels(records, cache, EventLog(stream=log))
            assert "is a symbolic link to" in str(refused.value) and "outside" in str(refused.value)
        elif "missing" in cases:
            assert verify_cached_wheels(records, cache, EventLog(stream=log)) == [
                w.filename for w, case, *_ in planted if case == "missing"]
        else:
            unusable = verify_cached_wheels(records, cache, EventLog(stream=log))
            assert unusable == [w.filename for w, case, *_ in planted if case != "ok"]
            assert len(log.getvalue().splitlines()) == len(unusable)    # one WARN line each
            for _wheel, case, path, data in planted:
                if case == "ok":
                    assert path.read_bytes() == data
                else:
                    assert not path.parent.exists() and not path.parent.is_symlink()
        for i in range(len(wheels)):       # what links pointed to is never touched
            outside = tmp / "outside" / f"{i}.whl"
            assert not outside.exists() or outside.read_bytes() == bytes([i]) + wheels[i][0]


PATCH_CASE = st.sampled_from(["ok", "missing", *LINKS, "short", "long", "other_bytes", "folder", "fifo"])


@settings(max_examples=EXAMPLES, deadline=None)
@given(patches=st.lists(st.tuples(st.binary(min_size=1, max_size=64), PATCH_CASE), min_size=1, max_size=4))
def test_fuzz_the_patches_staging(patches):
    """A compile's staged patches after the manifest was checked: the first patch that is not the
    pinned file itself stops the staging with a BuildFailure naming it; every patch staged before
    it is the pinned bytes, whole, and nothing else is staged."""
    import hashlib
    from types import SimpleNamespace
    from unittest import mock

    from build.errors import BuildFailure
    from build.kernels import compile as compile_stage
    from build.spec.shapes import SourcePatch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repo = tmp / "repo"
        pinned = []
        for i, (data, case) in enumerate(patches):
            rel = f"build/patches/p{i}.patch"
            _plant(repo / rel, case, data, outside=tmp / "outside" / f"{i}.patch",
                   inside=repo / "build" / "patches" / f"copy-{i}.patch")
            pinned.append(SourcePatch(path=rel, sha256=hashlib.sha256(data).hexdigest(), reason="fuzz"))
        kernel = SimpleNamespace(name="k", patches=tuple(pinned))
        sdist = tmp / "k-1.0.tar.gz"
        sdist.write_bytes(b"sdist")
        inputs = tmp / "in"
        cases = [case for _data, case in patches]
        good = next((i for i, case in enumerate(cases) if case != "ok"), len(cases))
        with mock.patch.object(compile_stage, "REPO_ROOT", repo):
            if good < len(cases):
                with pytest.raises(BuildFailure) as refused:
                    compile_stage.stage_inputs(inputs, kernel, sdist)
                assert str(refused.value).startswith(f"the patch build/patches/p{good}.patch of k is not the file "
                                                     f"the manifest pins: {repo / pinned[good].path} ")
            else:
                compile_stage.stage_inputs(inputs, kernel, sdist)
        staged = {p.name: p.read_bytes() for p in (inputs / "patches").iterdir()}
        assert staged == {f"{i:02d}-p{i}.patch": patches[i][0] for i in range(good)}
        assert not any(p.is_symlink() for p in (inputs / "patches").iterdir())
