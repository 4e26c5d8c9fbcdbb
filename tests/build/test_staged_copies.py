"""What the build copies after its inputs were checked is checked again as it is copied: the
patches staged for a compile are the files themselves (never a link) with the manifest's exact
bytes, and a base image's layers are edited only if every member stays below the root, every
hard link points to a file the layers hold, and the account files it edits in memory are small."""
from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from pathlib import Path

import pytest

from build.errors import BuildFailure
from build.oci.baselayer import READ_CAP, TrainingUser, transform_layers
from build.resolve import load_plan
from build.spec import MANIFEST_PATH, REPO_ROOT

pytestmark = pytest.mark.unit
EPOCH = 1_700_000_000
USER = TrainingUser("trainer", 10001, 10001)


# ---- the patches a compile stages -------------------------------------------------------------

@pytest.fixture
def staging(tmp_path, monkeypatch):
    """causal-conv1d's plan, validated against the real manifest and patches, then staged from a
    copy of the repository's patches the test can change afterwards: (kernel, repo, sdist, inputs)."""
    from build.kernels import compile as compile_stage

    plan = load_plan(REPO_ROOT / "images" / "qwen27b", MANIFEST_PATH)
    kernel = next(k for k in plan.kernels if k.name == "causal-conv1d")
    assert len(kernel.patches) == 2
    repo = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "build" / "patches", repo / "build" / "patches")
    monkeypatch.setattr(compile_stage, "REPO_ROOT", repo)
    sdist = tmp_path / "causal_conv1d-1.7.0.tar.gz"
    sdist.write_bytes(b"sdist")
    return kernel, repo, sdist, tmp_path / "in"


def _staged(inputs: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((inputs / "patches").iterdir())}


def test_the_staged_patches_are_the_pinned_bytes(staging):
    from build.kernels.compile import stage_inputs

    kernel, repo, sdist, inputs = staging
    stage_inputs(inputs, kernel, sdist)
    assert _staged(inputs) == {f"{i:02d}-{Path(p.path).name}": (repo / p.path).read_bytes()
                               for i, p in enumerate(kernel.patches)}
    assert all(hashlib.sha256((repo / p.path).read_bytes()).hexdigest() == p.sha256 for p in kernel.patches)


def test_a_patch_replaced_by_a_link_after_validation_is_refused(staging, tmp_path):
    """Even a link to a file with the pinned bytes: what is staged is never read through a link."""
    from build.kernels.compile import stage_inputs

    kernel, repo, sdist, inputs = staging
    second = repo / kernel.patches[1].path
    outside = tmp_path / "outside.patch"
    outside.write_bytes(second.read_bytes())
    second.unlink()
    second.symlink_to(outside)
    with pytest.raises(BuildFailure) as refused:
        stage_inputs(inputs, kernel, sdist)
    assert str(refused.value) == (f"the patch {kernel.patches[1].path} of causal-conv1d is not the file the manifest "
                                  f"pins: {second} is a symbolic link to {outside}")
    assert refused.value.fix == (f"restore {kernel.patches[1].path} from git, or re-pin its sha256 in "
                                 "kernels_manifest.yaml after reviewing the change")
    assert list(_staged(inputs)) == [f"00-{Path(kernel.patches[0].path).name}"]   # nothing of the second


@pytest.mark.parametrize("change", ["same size, other bytes", "one byte more", "emptied"])
def test_a_patch_whose_bytes_changed_after_validation_is_refused(staging, change):
    from build.kernels.compile import stage_inputs

    kernel, repo, sdist, inputs = staging
    first = repo / kernel.patches[0].path
    data = first.read_bytes()
    changed = {"same size, other bytes": data.replace(b"CUDA", b"cuda", 1), "one byte more": data + b"\n",
               "emptied": b""}[change]
    assert changed != data
    first.write_bytes(changed)
    with pytest.raises(BuildFailure) as refused:
        stage_inputs(inputs, kernel, sdist)
    assert str(refused.value) == (
        f"the patch {kernel.patches[0].path} of causal-conv1d is not the file the manifest pins: {first} has sha256 "
        f"{hashlib.sha256(changed).hexdigest()}, but {kernel.patches[0].sha256} is recorded for it")
    assert _staged(inputs) == {}                      # the copy that failed its hash is not left behind


# ---- the base's layers, edited --------------------------------------------------------------------

def _layer(path: Path, members: list[tuple[str, str, bytes | str]]) -> Path:
    """A layer tar of (name, kind, data or link target) members, kind "dir", "file" or "hardlink";
    the account files are always there, after the given members."""
    accounts = [("etc", "dir", b""), ("etc/passwd", "file", b"root:x:0:0::/root:/bin/bash\n"),
                ("etc/group", "file", b"root:x:0:\n"), ("etc/shadow", "file", b"root:*:19000:0:99999:7:::\n"),
                ("etc/gshadow", "file", b"root:*::\n")]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data in members + [m for m in accounts if m[0] not in {n for n, _, _ in members}]:
            info = tarfile.TarInfo(name)
            info.mtime, info.mode = 1000, 0o755 if kind == "dir" else 0o644
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, str(data)
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _transform(tmp_path: Path, *layers: list) -> list:
    paths = [_layer(tmp_path / f"layer{i}.tar", members) for i, members in enumerate(layers)]
    outputs = [tmp_path / f"out{i}.tar.gz" for i in range(len(paths))]
    streams = [p.open("rb") for p in paths]
    try:
        return transform_layers(streams, USER, EPOCH, outputs)
    finally:
        for stream in streams:
            stream.close()


def _member_names(blob: Path) -> set[str]:
    with tarfile.open(blob) as tar:
        return set(tar.getnames())


def test_hard_links_to_a_file_of_this_or_an_earlier_layer_are_kept(tmp_path):
    blobs = _transform(tmp_path, [("usr", "dir", b""), ("usr/a", "file", b"A")],
                       [("usr/b", "file", b"B"), ("usr/b2", "hardlink", "usr/b"), ("usr/a2", "hardlink", "./usr/a")])
    assert {"usr/b2", "usr/a2", "home/trainer", "workspace"} <= _member_names(blobs[1].path)


USE_ANOTHER_BASE = "use another base: a container engine never writes such a layer"


@pytest.mark.parametrize("members, message", [
    ([("/etc/cron.d/evil", "file", b"x")],
     "layer 1 of the runtime base holds a member named '/etc/cron.d/evil', outside the image's root"),
    ([("usr/../../root/.ssh/authorized_keys", "file", b"x")],
     "layer 1 of the runtime base holds a member named 'usr/../../root/.ssh/authorized_keys', outside the "
     "image's root"),
    ([("usr", "dir", b""), ("usr/shadow", "hardlink", "../etc/shadow")],
     "/usr/shadow in layer 1 of the runtime base is a hard link to '../etc/shadow', which no layer so far holds"),
    ([("usr", "dir", b""), ("usr/host", "hardlink", "/etc/hostname")],
     "/usr/host in layer 1 of the runtime base is a hard link to '/etc/hostname', which no layer so far holds"),
    ([("usr", "dir", b""), ("usr/ghost", "hardlink", "usr/nothing")],
     "/usr/ghost in layer 1 of the runtime base is a hard link to 'usr/nothing', which no layer so far holds"),
    ([("usr", "dir", b""), ("usr/to-dir", "hardlink", "usr")],
     "/usr/to-dir in layer 1 of the runtime base is a hard link to 'usr', which no layer so far holds"),
])
def test_a_hostile_member_of_a_base_layer_is_refused_by_name(tmp_path, members, message):
    with pytest.raises(BuildFailure) as refused:
        _transform(tmp_path, members)
    assert str(refused.value) == message and refused.value.fix == USE_ANOTHER_BASE
    assert not (tmp_path / "out0.tar.gz").exists()           # no half-written layer is left


def test_a_hard_link_to_a_file_a_later_layer_holds_is_refused(tmp_path):
    with pytest.raises(BuildFailure) as refused:
        _transform(tmp_path, [("usr", "dir", b""), ("usr/early", "hardlink", "usr/late")],
                   [("usr/late", "file", b"L")])
    assert str(refused.value) == ("/usr/early in layer 1 of the runtime base is a hard link to 'usr/late', which no "
                                  "layer so far holds")


@pytest.mark.parametrize("name", ["etc/passwd", "etc/skel/.bashrc"])
def test_an_account_or_skeleton_file_over_the_cap_is_refused_before_it_is_read(tmp_path, name):
    members = [("etc", "dir", b""), ("etc/skel", "dir", b""), (name, "file", b"#" * (READ_CAP + 1))]
    with pytest.raises(BuildFailure) as refused:
        _transform(tmp_path, members)
    assert str(refused.value) == (f"/{name} in layer 1 of the runtime base holds {READ_CAP + 1} bytes, over the 16 "
                                  "MiB an account or skeleton file may have to be edited")
    assert refused.value.fix == USE_ANOTHER_BASE
    members[-1] = (name, "file", b"#" * READ_CAP if name.startswith("etc/skel") else
                   b"root:x:0:0::/root:/bin/bash\n" + b"#" * (READ_CAP - 28))
    assert _transform(tmp_path, members)                      # at the cap: edited
