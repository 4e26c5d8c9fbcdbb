"""The remote cache where the commands use it: `kernels build-here` looks up the local cache, then
the registry (verified as a build verifies), then compiles, and pushes what it compiled, signed;
a build pushes its kernel entries right after the kernel stage, so a later failure does not
lose them; `--trust-unsigned-cache` is recorded in the image's lock, and only then (a build
without it keeps its lock, and so its image ID, byte for byte); `--plan --json` shows a cache
state for each layer whose key can be known before building, and says what the others wait on."""
from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

import build.kernels.build_here as build_here_module
from build import pipeline
from build.cache import CacheLayout
from build.cli import kernels as kernels_cli
from build.errors import BuildFailure
from build.kernels.acceptance import Expected
from build.kernels.build_here import HostKernel
from build.kernels.store import KernelStore
from build.kernels.wheel_checks import CheckRow
from build.remote_cache import RemoteCache
from build.remote_cache.options import RemoteCacheOptions
from build.remote_cache.transport import CacheRegistry
from build.resolve import resolve
from build.resolve.this_host import with_archs
from build.spec import REPO_ROOT, PinnedFile, load_image_spec, load_manifest
from contracts.events import EventLog
from contracts.lock import load_lock
from contracts.schema import Problems
from tests.build import kernel_wheels
from tests.build.test_remote_cache import Log

pytestmark = pytest.mark.unit
KERNEL_SMOKE = REPO_ROOT / "images" / "kernel-smoke"


# ---- kernels build-here ------------------------------------------------------------------------

def host_plan(image_dir: Path, manifest_path: Path, archs: tuple[str, ...]):
    """plan_here for a stand-in host: the image's toolchain, an installed torch of its own."""
    problems = Problems()
    manifest = load_manifest(manifest_path, problems)
    spec = load_image_spec(image_dir, problems)
    toolchain = manifest.toolchains[spec.toolchain]
    return resolve(with_archs(spec, archs), manifest, problems,
                   host=(toolchain, PinnedFile(filename="torch (installed)", sha256="7" * 64)))


def publish_kernel(store: KernelStore, kernel, payload: bytes):
    """The entry a host build of `kernel` publishes: a wheel with SASS for its archs, and meta.json
    as compile.py writes it (so it proves itself against the kernel's inputs wherever it is fetched)."""
    return kernel_wheels.publish(store, kernel.key_inputs, payload=payload)


def remote(address: str, repo: str, *, sign=None, public=None, trust: bool = False) -> RemoteCache:
    log = Log()
    cache = RemoteCache(RemoteCacheOptions(registry=address, path=repo, timeout=10, sign_key=sign, public_key=public,
                                           trust_unsigned=trust), log.log)
    cache.test_log = log
    return cache


def build_here_cli(tmp_path: Path, *extra: str) -> list[str]:
    return ["build-here", str(KERNEL_SMOKE), "--arch", "sm_90", "--cache", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out"), "--lock", str(tmp_path / "host.lock.json"), *extra]


def test_build_here_takes_every_kernel_from_the_registry_compiles_nothing_and_installs_them(
        registry, keys, tmp_path, monkeypatch, capsys):
    plan = host_plan(KERNEL_SMOKE, REPO_ROOT / "kernels_manifest.yaml", ("sm_90",))
    source = KernelStore(CacheLayout(tmp_path / "elsewhere"))
    writer = remote(registry.address, "team/here", sign=keys["signer"][0])
    for kernel in plan.kernels:
        writer.queue_kernel(publish_kernel(source, kernel, f"# {kernel.name} from the registry\n".encode()))
    writer.flush()
    assert len(writer.pushed) == 2
    monkeypatch.setattr(build_here_module, "plan_here", host_plan)
    monkeypatch.setattr(build_here_module, "compile_here", lambda *a, **k: pytest.fail("compiled on a registry hit"))
    site = tmp_path / "site"
    code = kernels_cli.main(build_here_cli(tmp_path, "--install", str(site), "--cache-registry",
                                           f"{registry.address}/team/here", "--cache-key", str(keys["signer"][3])))
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary["cache"] == {"causal-conv1d": "hit registry", "flash-attn": "hit registry"}
    assert summary["kernels"] == {} and summary["remote_cache"]["hits"] == 2 and "WARN" not in out.err
    assert (site / "causal_conv1d" / "__init__.py").read_bytes() == b"# causal-conv1d from the registry\n"
    assert (site / "flash_attn" / "__init__.py").read_bytes() == b"# flash-attn from the registry\n"
    lock = json.loads((tmp_path / "host.lock.json").read_text())
    assert sorted(k["sha256"] for k in lock["kernels"]) == sorted(e.sha256 for e in source.entries())
    assert "build" not in lock      # signed entries: nothing to record
    # the local cache has them now: a second run asks nobody
    assert KernelStore(CacheLayout(tmp_path / "cache")).get(plan.kernels[0].key) is not None
    code = kernels_cli.main(build_here_cli(tmp_path, "--force"))
    assert code == 0 and json.loads(capsys.readouterr().out)["cache"]["flash-attn"] == "hit local"


def test_build_here_compiles_what_the_registry_refuses_or_lacks_and_pushes_it_signed(
        registry, keys, tmp_path, monkeypatch, capsys):
    plan = host_plan(KERNEL_SMOKE, REPO_ROOT / "kernels_manifest.yaml", ("sm_90",))
    conv, flash = plan.kernels
    unsigned = remote(registry.address, "team/here-refused", trust=True)
    unsigned.queue_kernel(publish_kernel(KernelStore(CacheLayout(tmp_path / "elsewhere")), conv, b"# unsigned\n"))
    unsigned.flush()
    before = CacheRegistry(registry.address, timeout=10).get_manifest("team/here-refused", f"kernel-{conv.key}")
    compiled = []

    def fake_compile(kernel, plan, *, cache, work, jobs, log):
        compiled.append(kernel.name)
        wheel = kernel_wheels.write_wheel(work / "out" / "dist", kernel.name, kernel.version, sass=kernel.archs,
                                          payload=f"# {kernel.name} compiled here\n".encode())
        return HostKernel(name=kernel.name, wheel=wheel, seconds=2.0, jobs=jobs, sources=1,
                          rows=[CheckRow(kernel.name, "import", "PASS", "")], sass=kernel.archs,
                          observed=dict(kernel_wheels.OBSERVED))

    monkeypatch.setattr(build_here_module, "plan_here", host_plan)
    monkeypatch.setattr(build_here_module, "compile_here", fake_compile)
    code = kernels_cli.main(build_here_cli(tmp_path, "--cache-registry", f"{registry.address}/team/here-refused",
                                           "--cache-key", str(keys["signer"][3]), "--sign", str(keys["signer"][2])))
    out = capsys.readouterr()
    assert code == 0, out.err
    assert sorted(compiled) == ["causal-conv1d", "flash-attn"]
    summary = json.loads(out.out)
    assert summary["cache"] == {"causal-conv1d": "miss (compiled in 2s)", "flash-attn": "miss (compiled in 2s)"}
    (warning,) = [line for line in out.err.splitlines() if "WARN" in line]
    assert f"kernel-{conv.key}" in warning and "unsigned" in warning and "compiling it here instead" in warning
    # flash-attn was pushed, signed: another runner takes it from the registry
    reader = remote(registry.address, "team/here-refused", public=keys["signer"][1])
    fresh = KernelStore(CacheLayout(tmp_path / "fresh"))
    with fresh.lock(flash.key):
        got = reader.fetch_kernel(fresh, Expected.of(flash, plan.toolchain))
    assert got is not None
    assert zipfile.ZipFile(got.wheel).read("flash_attn/__init__.py") == b"# flash-attn compiled here\n"
    # the refused entry is left as it was, never overwritten
    assert CacheRegistry(registry.address, timeout=10).get_manifest("team/here-refused",
                                                                     f"kernel-{conv.key}") == before
    assert summary["remote_cache"]["pushed"] == 1 and f"kernel-{conv.key}" in summary["remote_cache"]["refused"]


def test_build_here_refuses_sign_without_a_cache_registry(tmp_path, keys):
    from build.errors import SigningError

    with pytest.raises(SigningError, match="--cache-registry"):
        kernels_cli.main(build_here_cli(tmp_path, "--sign", str(keys["signer"][2])))


# ---- the pipeline: kernels pushed after their stage; the lock records unsigned trust ----------

def fake_smoke(tmp_path, monkeypatch):
    """The smoke plan, a cache holding stand-in wheels, a wheelhouse stage that returns them and
    a fake engine holding its bases (as tests/build/test_pipeline_logic.py builds them)."""
    from tests.build.test_pipeline_logic import engine_with_bases, smoke_with_stand_in_wheels

    plan, cache, _ = smoke_with_stand_in_wheels(tmp_path, monkeypatch)
    return plan, cache, engine_with_bases(plan)


def lock_of(tmp_path, monkeypatch, remote_cache, name: str) -> str:
    plan, cache, engine = fake_smoke(tmp_path / name, monkeypatch)
    out = tmp_path / name / "out"
    pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=EventLog(quiet=True),
                         engine=engine, remote=remote_cache)
    return (out / "build.lock.json").read_text()


def test_trust_unsigned_cache_is_in_the_lock_only_when_given(tmp_path, monkeypatch, keys):
    offline = "127.0.0.1:9"    # nothing is fetched or pushed for the smoke image's dockerfile build
    plain = lock_of(tmp_path, monkeypatch, None, "plain")
    signed = lock_of(tmp_path, monkeypatch, remote(offline, "team/x", public=keys["signer"][1]), "signed")
    unsigned = lock_of(tmp_path, monkeypatch, remote(offline, "team/x", trust=True), "unsigned")
    assert signed == plain and '"build"' not in plain        # same bytes: same lock label, same image
    data = json.loads(unsigned)
    assert data["build"] == {"remote_cache_trust": "unsigned"}
    assert {k: v for k, v in data.items() if k != "build"} == json.loads(plain)
    # verify/ and entrypoint/ read it with the one lock reader, and it round-trips byte for byte
    path = tmp_path / "unsigned.lock.json"
    path.write_text(unsigned)
    lock = load_lock(path)
    assert lock.build == {"remote_cache_trust": "unsigned"} and lock.to_json() == unsigned
    path.write_text(plain)
    assert load_lock(path).to_json() == plain


def test_the_kernel_entries_are_pushed_even_when_a_later_stage_fails(registry, keys, tmp_path, monkeypatch):
    from build import kernels as kernel_stage
    from tests.build.test_remote_cache import make_kernel, only_entry

    plan, cache, engine = fake_smoke(tmp_path, monkeypatch)
    entry = only_entry(make_kernel(tmp_path / "k"))
    monkeypatch.setattr(kernel_stage, "provide_kernels", lambda *a, **k: kernel_stage.ProvidedKernels(
        wheels=(), states={"causal-conv1d": "miss (compiled in 600s)"}, entries={entry.key: entry}))

    def broken_render(*args, **kwargs):
        raise BuildFailure("rendering failed", "a later stage")

    monkeypatch.setattr(pipeline, "render_context", broken_render)
    writer = remote(registry.address, "team/early", sign=keys["signer"][0])
    with pytest.raises(BuildFailure, match="rendering failed"):
        pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=tmp_path / "out",
                             log=EventLog(quiet=True), engine=engine, remote=writer)
    assert writer.pushed == [f"kernel-{entry.key}"]
    assert CacheRegistry(registry.address, timeout=10).get_manifest("team/early", f"kernel-{entry.key}") is not None


# ---- --plan: a cache state per layer, where its key is known before building -----------------

def plan_layers(tmp_path, *extra: str) -> dict[str, dict]:
    from tests.conftest import run_build_cli

    proc = run_build_cli("images/smoke", "--plan", "--json", "--cache", str(tmp_path / "cache"), *extra,
                         env={"SOURCE_DATE_EPOCH": "1700000000", "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert proc.returncode == 0, proc.stderr
    return {row["layer"]: row for row in json.loads(proc.stdout)["layers"]}


def test_plan_json_shows_each_layers_cache_state_or_what_its_key_waits_on(registry, keys, tmp_path, monkeypatch):
    from build.oci.layercache import LayerCache
    from build.oci.tarlayer import TreeEntry, write_layer

    rows = plan_layers(tmp_path)
    assert list(rows) == ["base", "venv", "lock", "app"]
    assert rows["base"]["state"] == "unknown" and rows["base"]["key"] is None
    assert rows["base"]["detail"].startswith("unknown until the runtime base is bootstrapped")
    assert "no engine" in rows["base"]["detail"]
    assert rows["venv"]["state"] == "unknown" and "base layers' diffIDs" in rows["venv"]["detail"]
    assert rows["lock"]["state"] == "unknown" and "build.lock.json" in rows["lock"]["detail"]
    app = rows["app"]
    assert app["state"] == "miss" and len(app["key"]) == 64

    # the key is the build's: the app layer of the context a build renders
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    from build.context.render import APP_DIR, render_context
    from build.oci.image import tree_layer_key
    from build.oci.runtime_image import app_extra
    from build.resolve import load_plan

    context = render_context(load_plan(REPO_ROOT / "images" / "smoke"), tmp_path / "context", wheels=(),
                             cache=CacheLayout(tmp_path / "render-cache"))
    assert tree_layer_key("app", context.directory / "app", APP_DIR, 1700000000,
                          app_extra((context.directory / "ftimage-gate").read_bytes()))[0] == app["key"]

    # an entry in the registry under that key: "hit registry"; then in the local cache: "hit local"
    source = LayerCache(tmp_path / "elsewhere")
    files = [TreeEntry("opt", "dir", mode=0o755), TreeEntry("opt/app.py", "file", data=b"stand-in\n")]
    entry = source.get_or_make(app["key"], "app", "ftimage app", 1700000000,
                               lambda path: write_layer(path, files, 1700000000))
    writer = remote(registry.address, "team/planlayers", sign=keys["signer"][0])
    writer.queue_layer(entry)
    writer.flush()
    assert writer.pushed == [f"layer-{app['key']}"]
    rows = plan_layers(tmp_path, "--cache-registry", f"{registry.address}/team/planlayers",
                       "--cache-key", str(keys["signer"][3]))
    assert rows["app"]["state"] == "hit registry" and rows["app"]["key"] == app["key"]
    assert rows["base"]["state"] == "unknown"
    shutil.copytree(source.root / app["key"], tmp_path / "cache" / "layers" / app["key"])
    assert plan_layers(tmp_path)["app"]["state"] == "hit local"


def test_plan_reads_the_runtime_base_from_the_engine_for_the_base_and_venv_keys(tmp_path):
    from build.base.bootstrap import SPEC_LABEL, base_tag
    from build.cli.plan_layers import layer_rows
    from build.oci.baselayer import TrainingUser, base_keys
    from build.oci.layercache import CachedLayer, LayerCache
    from build.resolve import digest, load_plan
    from tests.fakes.engine import FakeEngine

    plan = load_plan(REPO_ROOT / "images" / "smoke")
    cache = CacheLayout(tmp_path / "cache")
    assert layer_rows(plan, cache, engine=FakeEngine())[0]["detail"].endswith("is not in the engine)")
    base = plan.spec.runtime_base.bootstrap
    diff_ids = ["sha256:" + "1" * 64, "sha256:" + "2" * 64]
    engine = FakeEngine(images={base_tag(base): {"Id": "sha256:" + "b" * 64, "RootFS": {"Layers": diff_ids},
                                                 "Config": {"Labels": {SPEC_LABEL: "another spec"}}}})
    assert layer_rows(plan, cache, engine=engine)[0]["state"] == "unknown"      # not this base's spec
    engine.images[base_tag(base)]["Config"]["Labels"][SPEC_LABEL] = digest(base.spec_dict())
    rows = layer_rows(plan, cache, engine=engine)
    user = plan.spec.user
    keys = base_keys(diff_ids, TrainingUser(user.name, user.uid, plan.spec.gid))
    assert [(r["layer"], r["key"], r["state"]) for r in rows[:2]] == [("base 1/2", keys[0], "miss"),
                                                                      ("base 2/2", keys[1], "miss")]
    assert rows[2]["layer"] == "venv" and "base layers are assembled" in rows[2]["detail"]
    # the edited base layers in the local cache: the venv's key now waits on the wheelhouse only
    layers = LayerCache(cache.layers)
    for i, key in enumerate(keys):
        staging = layers.staging()
        (staging / "layer.tar.gz").write_bytes(b"x")
        layers.publish(key, staging, CachedLayer(key=key, name="base", diff_id="sha256:" + str(i + 5) * 64,
                                                 digest="sha256:" + "0" * 64, size=1, created_by="b", mtime=0,
                                                 path=staging / "layer.tar.gz"))
    rows = layer_rows(plan, cache, engine=engine)
    assert rows[0]["state"] == rows[1]["state"] == "hit local"
    assert rows[2]["state"] == "unknown" and "wheelhouse is resolved" in rows[2]["detail"]
