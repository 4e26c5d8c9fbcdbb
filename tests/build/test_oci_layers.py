"""The image assembler's parts without dockerd: deterministic layers, the refusals, the edited
base, the venv installed with `installer`, the canonical config, the docker-archive that skips
what the engine holds, and the mismatch report of verify-reproducible."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from build.audit.reproducible import BuildResult, compare
from build.engine import RunResult
from build.errors import BuildFailure
from build.oci import depcheck, docker_archive
from build.oci.baselayer import TrainingUser, transform_layers
from build.oci.image import RuntimeSettings, assemble, read_layout, write_layout
from build.oci.layercache import CachedLayer, LayerCache
from build.oci.tarlayer import LayerTreeErrors, parents, tree_entries, write_layer
from build.oci.venv import COMPILE_SCRIPT, LockedWheel, venv_layer
from contracts.events import EventLog
from tests.fakes.engine import FakeEngine

pytestmark = pytest.mark.unit
QUIET = EventLog(quiet=True)
EPOCH = 1_700_000_000


def fresh(path: Path) -> Path:
    path.mkdir()
    return path


def stage_tree(root: Path, umask: int) -> Path:
    old = os.umask(umask)
    try:
        (root / "pkg" / "sub").mkdir(parents=True)
        (root / "pkg" / "a.py").write_text("print('a')\n")
        (root / "pkg" / "sub" / "b.json").write_text("{}\n")
        tool = root / "pkg" / "tool"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o700 & ~umask | 0o100)
        (root / "pkg" / "link").symlink_to("a.py")
    finally:
        os.umask(old)
    return root


def members(blob: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(blob) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_the_same_tree_gives_the_same_layer_whatever_the_umask_and_file_times(tmp_path):
    a = stage_tree(tmp_path / "a", 0o022)
    b = stage_tree(tmp_path / "b", 0o077)
    os.utime(b / "pkg" / "a.py", (1, 1))
    blob_a = write_layer(tmp_path / "a.tar.gz", [*parents("opt/app"), *tree_entries(a, "opt/app")], EPOCH)
    blob_b = write_layer(tmp_path / "b.tar.gz", [*parents("opt/app"), *tree_entries(b, "opt/app")], EPOCH)
    assert (blob_a.diff_id, blob_a.digest) == (blob_b.diff_id, blob_b.digest)
    assert blob_a.digest == "sha256:" + hashlib.sha256((tmp_path / "a.tar.gz").read_bytes()).hexdigest()
    raw = __import__("gzip").decompress((tmp_path / "a.tar.gz").read_bytes())
    assert blob_a.diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert (tmp_path / "a.tar.gz").read_bytes()[4:8] == b"\0\0\0\0"      # gzip header mtime 0
    found = members(tmp_path / "b.tar.gz")
    assert list(found) == ["opt", "opt/app", "opt/app/pkg", "opt/app/pkg/a.py", "opt/app/pkg/link",
                           "opt/app/pkg/sub", "opt/app/pkg/sub/b.json", "opt/app/pkg/tool"]
    assert {m.mtime for m in found.values()} == {EPOCH}
    assert {(m.uid, m.gid, m.uname, m.gname) for m in found.values()} == {(0, 0, "", "")}
    assert found["opt/app/pkg"].mode == 0o755 and found["opt/app/pkg/a.py"].mode == 0o644
    assert found["opt/app/pkg/tool"].mode == 0o755 and found["opt/app/pkg/link"].linkname == "a.py"


def test_a_changed_byte_or_time_changes_the_layer(tmp_path):
    tree = stage_tree(tmp_path / "t", 0o022)
    first = write_layer(tmp_path / "1.tar.gz", tree_entries(tree, "x"), EPOCH)
    later = write_layer(tmp_path / "2.tar.gz", tree_entries(tree, "x"), EPOCH + 1)
    (tree / "pkg" / "a.py").write_text("print('b')\n")
    edited = write_layer(tmp_path / "3.tar.gz", tree_entries(tree, "x"), EPOCH)
    assert len({first.diff_id, later.diff_id, edited.diff_id}) == 3


def test_hard_links_inside_the_tree_become_tar_links_and_links_leaving_it_are_refused(tmp_path):
    tree = stage_tree(tmp_path / "t", 0o022)
    os.link(tree / "pkg" / "a.py", tree / "pkg" / "sub" / "same.py")
    blob = write_layer(tmp_path / "l.tar.gz", tree_entries(tree, "x"), EPOCH)
    found = members(blob.path)
    assert found["x/pkg/sub/same.py"].islnk() and found["x/pkg/sub/same.py"].linkname == "x/pkg/a.py"
    os.link(tree / "pkg" / "tool", tmp_path / "outside")
    with pytest.raises(LayerTreeErrors) as refused:
        list(tree_entries(tree, "x"))
    assert "x/pkg/tool" in refused.value.render() and "copy the file" in refused.value.render()


def test_special_files_and_files_of_other_owners_are_refused_with_the_fix(tmp_path):
    tree = stage_tree(tmp_path / "t", 0o022)
    os.mkfifo(tree / "pkg" / "pipe")
    with pytest.raises(LayerTreeErrors) as refused:
        list(tree_entries(tree, "x"))
    text = refused.value.render()
    assert "x/pkg/pipe" in text and "a FIFO" in text and "remove it from the staged tree" in text
    (tree / "pkg" / "pipe").unlink()
    if os.geteuid() == 0:
        os.mknod(tree / "pkg" / "dev", 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        with pytest.raises(LayerTreeErrors, match="1 problem"):
            list(tree_entries(tree, "x"))
        (tree / "pkg" / "dev").unlink()
        os.chown(tree / "pkg" / "a.py", 4242, 4242)
        with pytest.raises(LayerTreeErrors) as unmapped:
            list(tree_entries(tree, "x"))
        assert "owned by uid 4242" in unmapped.value.render()
    with pytest.raises(LayerTreeErrors) as other:   # the tree as another builder would see it
        list(tree_entries(tree, "x", builder_uid=os.getuid() + 1))
    assert "which this layer cannot map" in other.value.render() and "stage the tree" in other.value.render()


def test_a_refused_tree_leaves_nothing_in_the_layer_cache(tmp_path):
    tree = stage_tree(tmp_path / "t", 0o022)
    os.mkfifo(tree / "pkg" / "pipe")
    cache = LayerCache(tmp_path / "layers")
    with pytest.raises(LayerTreeErrors):
        cache.get_or_make("k" * 64, "app", "x", EPOCH, lambda path: write_layer(path, tree_entries(tree, "x"), EPOCH))
    assert list((tmp_path / "layers").iterdir()) == []


def test_layers_another_build_is_still_assembling_survive_a_prune(tmp_path):
    """Two builds on one host: one prunes what no image's newest build uses while the other has
    made a layer it has not recorded yet. That layer must survive; once recorded, only the
    superseded entry goes."""
    tree = stage_tree(tmp_path / "t", 0o022)
    pruning, assembling = LayerCache(tmp_path / "layers"), LayerCache(tmp_path / "layers")
    make = lambda path: write_layer(path, tree_entries(tree, "x"), EPOCH)  # noqa: E731
    superseded = pruning.get_or_make("b" * 64, "app", "x", EPOCH, make)
    pruning.record_use("smoke", [])
    with assembling.assembling():
        fresh = assembling.get_or_make("a" * 64, "app", "x", EPOCH, make)
        assert pruning.prune_unused() == [] and fresh.path.is_file() and superseded.path.is_file()
        assembling.record_use("kernel-smoke", ["a" * 64])
    assert pruning.prune_unused() == ["b" * 64]
    assert fresh.path.is_file() and not superseded.path.exists()


def test_a_cache_entry_is_reused_and_a_damaged_one_is_rebuilt(tmp_path):
    tree = stage_tree(tmp_path / "t", 0o022)
    cache = LayerCache(tmp_path / "layers")
    made = []

    def make(path):
        made.append(path)
        return write_layer(path, tree_entries(tree, "x"), EPOCH)

    first = cache.get_or_make("a" * 64, "app", "x", EPOCH, make)
    again = cache.get_or_make("a" * 64, "app", "x", EPOCH, make)
    assert (first.reused, again.reused, len(made)) == (False, True, 1) and first.digest == again.digest
    with first.path.open("ab") as fh:
        fh.write(b"junk")
    rebuilt = cache.lookup("a" * 64)
    assert rebuilt is None    # size disagrees with layer.json: not served


def test_a_blob_edited_in_place_with_the_same_size_is_never_reused_and_is_rebuilt(tmp_path):
    """Size is not content: a byte flipped in a cached blob would be loaded and then refused by
    every registry (DIGEST_INVALID). The hit is re-hashed, the damaged entry removed and rebuilt."""
    tree = stage_tree(tmp_path / "t", 0o022)
    cache = LayerCache(tmp_path / "layers")
    made = []

    def make(path):
        made.append(path)
        return write_layer(path, tree_entries(tree, "x"), EPOCH)

    first = cache.get_or_make("b" * 64, "app", "x", EPOCH, make)
    data = bytearray(first.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    first.path.write_bytes(bytes(data))            # same size, other bytes
    again = cache.get_or_make("b" * 64, "app", "x", EPOCH, make)
    assert len(made) == 2 and not again.reused and cache.damaged == ["b" * 64]
    assert again.digest == first.digest and again.path.read_bytes() != bytes(data)
    assert cache.get_or_make("b" * 64, "app", "x", EPOCH, make).reused and len(made) == 2


# ---- the base ---------------------------------------------------------------------------------

def base_tar(path: Path, *, passwd: str = "root:x:0:0:root:/root:/bin/bash\n") -> Path:
    files = {"etc/passwd": passwd, "etc/group": "root:x:0:\nshadow:x:42:\n",
             "etc/shadow": "root:*:19000:0:99999:7:::\n", "etc/gshadow": "root:*::\n",
             "etc/skel/.bashrc": "# bashrc\n", "usr/bin/su": "ELF", "usr/share/python-wheels/pip.whl": "PK",
             "usr/bin/ping": "ELF"}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("etc", "etc/skel", "home", "usr", "usr/bin", "usr/share", "usr/share/python-wheels"):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1000
            tar.addfile(info)
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(text), 1000
            info.mode = 0o4755 if name == "usr/bin/su" else 0o640 if "shadow" in name else 0o644
            if name == "usr/bin/ping":
                info.pax_headers = {"SCHILY.xattr.security.capability": "\x01\x00\x00\x02"}
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def read_member(blob: Path, name: str) -> bytes:
    with tarfile.open(blob) as tar:
        return tar.extractfile(name).read()


def test_the_base_layer_loses_setuid_bits_pip_wheels_and_capabilities_and_gains_the_user(tmp_path):
    user = TrainingUser("trainer", 10001, 10001)
    outs = []
    for run in ("1", "2"):
        with base_tar(tmp_path / f"base{run}.tar").open("rb") as stream:
            outs.append(transform_layers([stream], user, EPOCH, [tmp_path / f"out{run}.tar.gz"])[0])
    assert outs[0].diff_id == outs[1].diff_id and outs[0].digest == outs[1].digest
    found = members(outs[0].path)
    assert found["usr/bin/su"].mode == 0o755
    assert not [n for n in found if "python-wheels" in n]
    assert not [k for m in found.values() for k in m.pax_headers if "xattr" in k]
    passwd = read_member(outs[0].path, "etc/passwd").decode()
    assert passwd.endswith("trainer:x:10001:10001::/home/trainer:/bin/bash\n")
    assert read_member(outs[0].path, "etc/shadow").decode().endswith(f"trainer:!:{EPOCH // 86400}:0:99999:7:::\n")
    assert found["etc/shadow"].mode == 0o640
    assert (found["home/trainer"].uid, found["home/trainer"].mode) == (10001, 0o755)
    assert read_member(outs[0].path, "home/trainer/.bashrc") == b"# bashrc\n"
    assert (found["home/trainer/.bashrc"].uid, found["workspace"].uid, found["workspace"].gid) == (10001, 10001, 10001)


def test_a_user_the_base_already_has_is_a_clear_failure(tmp_path):
    tar = base_tar(tmp_path / "base.tar", passwd="root:x:0:0::/root:/bin/bash\nother:x:10001:10001::/:/bin/sh\n")
    with tar.open("rb") as stream, pytest.raises(BuildFailure) as failed:
        transform_layers([stream], TrainingUser("trainer", 10001, 10001), EPOCH, [tmp_path / "o.tar.gz"])
    assert "uid 10001 is already 'other'" in str(failed.value) and "runtime.uid" in failed.value.fix


# ---- the venv ---------------------------------------------------------------------------------

WHEEL_FILE = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> Path:
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)
    contents = {**files, f"{dist_info}/METADATA": metadata.encode(),
                f"{dist_info}/WHEEL": WHEEL_FILE}
    rows = []
    for path, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append([path, f"sha256={digest}", str(len(data))])
    rows.append([f"{dist_info}/RECORD", "", ""])
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows(rows)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in {**contents, f"{dist_info}/RECORD": record.getvalue().encode()}.items():
            archive.writestr(zipfile.ZipInfo(path, date_time=(2024, 5, 1, 12, 0, 0)), data)
    return wheel


def compiling_engine(venv: str) -> FakeEngine:
    """A fake engine whose 'container' is this host's python3, run on the staged folder."""
    def run(image, command, *, volumes, environment, **kwargs):
        (stage, spec), = volumes.items()
        site = command[-2].replace(spec["bind"], stage)
        done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, site, command[-1]], capture_output=True, text=True,
                              env={**os.environ, **environment})
        return RunResult(done.returncode, done.stdout.replace(sys.version.split()[0], "3.11.2") + done.stderr)
    return FakeEngine(on_run=run)


def locked(wheel: Path) -> LockedWheel:
    return LockedWheel(wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest(), wheel)


def build_venv(tmp_path: Path, wheels: list[Path], name: str = "v") -> CachedLayer:
    scratch = tmp_path / f"scratch-{name}"
    scratch.mkdir()
    return venv_layer(engine=compiling_engine("/opt/ftimage/venv"), cache=LayerCache(tmp_path / "layers"),
                      scratch=scratch, wheels=[locked(w) for w in wheels], venv="/opt/ftimage/venv",
                      app_dir="/opt/ftimage/app", python_minor=f"{sys.version_info[0]}.{sys.version_info[1]}",
                      base_ref="base:1", base_diff_ids=["sha256:" + "0" * 64], log=QUIET)


@pytest.fixture
def wheels(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    return [make_wheel(folder, "alpha", "1.0", {"alpha/__init__.py": b"VALUE = {'a', 'b', 'c'}\n",
                                                  "alpha/libstatic.a": b"!<arch>\n"}, requires=("beta>=2",)),
            make_wheel(folder, "beta", "2.1", {"beta.py": b"X = 1\n"},
                       requires=("gamma; sys_platform == 'win32'", "delta; extra == 'docs'"))]


def test_the_venv_layer_installs_compiles_and_records_everything_it_ships(tmp_path, wheels):
    layer = build_venv(tmp_path, wheels)
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    site = f"opt/ftimage/venv/lib/python{minor}/site-packages"
    found = members(layer.path)
    assert f"{site}/alpha/libstatic.a" not in found
    record = read_member(layer.path, f"{site}/alpha-1.0.dist-info/RECORD").decode()
    assert "libstatic.a" not in record
    pyc = f"alpha/__pycache__/__init__.{sys.implementation.cache_tag}.pyc"
    assert pyc in record and f"{site}/{pyc}" in found
    data = read_member(layer.path, f"{site}/{pyc}")
    assert int.from_bytes(data[4:8], "little") == 3          # checked-hash .pyc (PEP 552)
    assert read_member(layer.path, f"{site}/alpha-1.0.dist-info/INSTALLER") == b"ftimage\n"
    assert read_member(layer.path, f"{site}/ftimage-app.pth") == b"/opt/ftimage/app\n"
    assert b"version = 3.11.2" in read_member(layer.path, "opt/ftimage/venv/pyvenv.cfg")
    assert found["opt/ftimage/venv/bin/python3"].linkname == "/usr/bin/python3"
    assert {m.mtime for m in found.values()} == {1714564800}     # the wheels' newest entry, not today


def test_the_venv_layer_is_the_same_from_a_second_fresh_cache(tmp_path, wheels):
    first = build_venv(fresh(tmp_path / "one"), wheels, "1")
    second = build_venv(fresh(tmp_path / "two"), wheels, "2")
    assert (first.diff_id, first.digest) == (second.diff_id, second.digest) and not second.reused


def test_a_wheel_that_does_not_match_the_lock_is_named(tmp_path, wheels):
    scratch = tmp_path / "s"
    scratch.mkdir()
    bad = LockedWheel(wheels[0].name, "0" * 64, wheels[0])
    with pytest.raises(BuildFailure) as failed:
        venv_layer(engine=compiling_engine("/v"), cache=LayerCache(tmp_path / "layers"), scratch=scratch,
                   wheels=[bad, locked(wheels[1])], venv="/v", app_dir="/a", python_minor="3.11", base_ref="b",
                   base_diff_ids=[], log=QUIET)
    assert wheels[0].name in str(failed.value) and "cache entry" in failed.value.fix
    assert not (tmp_path / "layers").exists() or list((tmp_path / "layers").iterdir()) == []


def test_unmet_dependencies_fail_the_venv_like_pip_check(tmp_path, wheels):
    with pytest.raises(BuildFailure) as failed:
        build_venv(tmp_path, wheels[:1])
    assert "alpha 1.0 requires beta>=2, which is not installed" in str(failed.value)


def test_dependency_markers_are_evaluated_for_the_image_not_this_host(tmp_path):
    site = tmp_path / "site"
    for name, version, requires in (("a", "1", ["b<2", "c; python_version < '3.8'", "d; extra == 'x'"]),
                                    ("b", "2.0", [])):
        (site / f"{name}-{version}.dist-info").mkdir(parents=True)
        (site / f"{name}-{version}.dist-info" / "METADATA").write_text(
            f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    assert depcheck.dependency_problems(site, "3.11.2") == ["a 1 requires b<2, but b 2.0 is installed"]
    assert "c; python_version < \"3.8\"" in depcheck.dependency_problems(site, "3.7.1")[1]


# ---- config, layout, loading ------------------------------------------------------------------

def cached(tmp_path: Path, name: str, text: str, mtime: int = EPOCH) -> CachedLayer:
    from build.oci.tarlayer import TreeEntry

    blob = write_layer(tmp_path / f"{name}.tar.gz", [TreeEntry(f"{name}.txt", "file", data=text.encode())], mtime)
    return CachedLayer(key=name, name=name, diff_id=blob.diff_id, digest=blob.digest, size=blob.size,
                       created_by=f"make {name}", mtime=mtime, path=blob.path)


SETTINGS = RuntimeSettings(user="10001:10001", env=["PATH=/bin"], entrypoint=["/bin/true"], cmd=["info"],
                           workdir="/workspace", labels={"b": "2", "a": "1"})


def test_the_config_and_manifest_are_canonical_and_name_each_layer(tmp_path):
    layers = [cached(tmp_path, "base", "b", 1000), cached(tmp_path, "app", "a")]
    image = assemble(layers, SETTINGS, EPOCH)
    config = json.loads(image.config)
    assert image.config == json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    assert image.image_id == "sha256:" + hashlib.sha256(image.config).hexdigest()
    assert config["rootfs"]["diff_ids"] == [layer.diff_id for layer in layers]
    assert [h["created"] for h in config["history"]] == ["1970-01-01T00:16:40Z", "2023-11-14T22:13:20Z"]
    assert "container" not in config and "container_config" not in config and "hostname" not in image.config.decode()
    manifest = json.loads(image.manifest)
    assert [entry["digest"] for entry in manifest["layers"]] == [layer.digest for layer in layers]
    assert manifest["config"]["digest"] == image.image_id
    assert assemble(layers, SETTINGS, EPOCH).manifest == image.manifest


def test_the_oci_layout_holds_exactly_the_image(tmp_path):
    layers = [cached(tmp_path, "base", "b"), cached(tmp_path, "app", "a")]
    image = assemble(layers, SETTINGS, EPOCH)
    layout = write_layout(image, tmp_path / "out", "smoke:1")
    manifest, config, blobs = read_layout(layout)
    assert (manifest, config) == (image.manifest, image.config)
    assert [hashlib.sha256(b.read_bytes()).hexdigest() for b in blobs] == [lay.digest[7:] for lay in layers]
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}


def test_the_engine_is_sent_only_the_layers_it_lacks(tmp_path):
    base, venv = cached(tmp_path, "base", "b"), cached(tmp_path, "venv", "v")
    engine = FakeEngine()
    first = assemble([base, venv, cached(tmp_path, "app", "one")], SETTINGS, EPOCH)
    engine.images_with_label = lambda label: [{"Id": i["Id"]} for i in engine.images.values()]
    loaded, sent = docker_archive.load(engine, first.config, "smoke:1", first.layers, first.image_id)
    assert (loaded, sent) == (first.image_id, 3)
    after_commit = assemble([base, venv, cached(tmp_path, "app", "two")], SETTINGS, EPOCH + 60)
    loaded, sent = docker_archive.load(engine, after_commit.config, "smoke:1", after_commit.layers,
                                       after_commit.image_id)
    assert (loaded, sent) == (after_commit.image_id, 1)


def test_a_layer_the_engine_dropped_meanwhile_is_sent_on_retry(tmp_path):
    layers = [cached(tmp_path, "base", "b"), cached(tmp_path, "app", "a")]
    image = assemble(layers, SETTINGS, EPOCH)
    engine = FakeEngine()
    stale = {"Id": "sha256:" + "e" * 64, "RootFS": {"Layers": [layers[0].diff_id]}, "Config": {"Labels": {}}}
    engine.images_with_label = lambda label: [stale]
    engine.image = lambda ref: stale if ref == stale["Id"] else FakeEngine.image(engine, ref)
    loaded, sent = docker_archive.load(engine, image.config, "smoke:1", layers, image.image_id)
    assert (loaded, sent) == (image.image_id, 2) and engine.count("load_stream") == 2


def test_a_fetched_layer_that_fails_its_check_during_the_load_leaves_no_image_and_no_entry(tmp_path):
    """The diffID check of a fetched layer runs while the engine loads the image: when it fails,
    the loaded image is removed and the layer is neither published nor left in staging."""
    from build.oci.layercache import LayerCache, RefusedLayers
    from build.oci.runtime_image import load_and_settle

    good, fetched = cached(tmp_path, "base", "b"), cached(tmp_path, "app", "a")
    cache = LayerCache(tmp_path / "fresh")
    staging = cache.staging()
    (staging / "layer.tar.gz").write_bytes(fetched.path.read_bytes())

    def wrong(blob):
        raise ValueError("its layer's tar has diffID sha256:0000, layer.json says sha256:1111")

    pending = cache.defer(fetched.key, staging, fetched, wrong)
    image = assemble([good, pending], SETTINGS, EPOCH)
    engine = FakeEngine()
    engine.images_with_label = lambda label: []
    with pytest.raises(RefusedLayers) as refused:
        load_and_settle(engine, image, "smoke:1", [good, pending], cache)
    assert list(refused.value.refused) == [fetched.key] and "diffID" in str(refused.value)
    assert engine.count("load_stream") == 1 and engine.image(image.image_id) is None
    assert "smoke:1" not in engine.images and cache.lookup(fetched.key) is None
    assert not list((tmp_path / "fresh").glob(".tmp-*"))

    ok_staging = cache.staging()
    (ok_staging / "layer.tar.gz").write_bytes(fetched.path.read_bytes())
    pending = cache.defer(fetched.key, ok_staging, replace(fetched, path=cache.root / fetched.key / "layer.tar.gz"),
                          lambda blob: None)
    assert load_and_settle(engine, image, "smoke:1", [good, pending], cache) == 2
    assert cache.lookup(fetched.key) is not None and engine.images["smoke:1"]["Id"] == image.image_id


# ---- verify-reproducible's report ---------------------------------------------------------------

def test_a_mismatch_names_the_first_differing_layer_and_its_paths(tmp_path):
    from build.oci.tarlayer import TreeEntry

    def build(label: str, mtime: int) -> BuildResult:
        base = cached(fresh(tmp_path / label), "base", "b")
        blob = write_layer(tmp_path / label / "app.tar.gz",
                           [TreeEntry("app", "dir"), TreeEntry("app/x.py", "file", data=b"x"),
                            TreeEntry("app/y.py", "file", data=label.encode())], mtime)
        app = CachedLayer(key="a", name="app", diff_id=blob.diff_id, digest=blob.digest, size=blob.size,
                          created_by="app", mtime=mtime, path=blob.path)
        image = assemble([base, app], SETTINGS, EPOCH)
        layout = write_layout(image, tmp_path / label, "smoke:1")
        return BuildResult(label=label, conditions="", image_id=image.image_id,
                           manifest_digest=image.manifest_digest, diff_ids=image.diff_ids, lock_sha256="l",
                           layout=str(layout))

    a, b = build("A", EPOCH), build("B", EPOCH + 1)
    result = compare(a, b)
    assert not result.same and result.first_differing_layer == 1
    assert result.differing_paths[0].startswith("app: mtime")
    assert any(p.startswith("app/y.py:") and "content" in p and "mtime" in p for p in result.differing_paths)
    rendered = result.render(a, b)
    assert "NOT REPRODUCIBLE" in rendered and "layer 2 differs" in rendered
    same = compare(a, a)
    assert same.same and "REPRODUCIBLE" in same.render(a, a)
