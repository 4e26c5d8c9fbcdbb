"""Cache-hit and rebuild logic of the pipeline and the kernel stage, against a fake engine (no
dockerd): the real engine is covered by the engine tier."""
from __future__ import annotations

import hashlib
import io
import json
import time
from pathlib import Path

import pytest

import build.kernels as kernel_stage
from build import pipeline
from build.base.bootstrap import SPEC_LABEL, base_tag
from build.cache import CacheLayout
from build.engine import RunResult
from build.errors import BuildFailure
from build.kernels.store import KernelStore
from build.resolve import digest, load_plan
from build.spec import REPO_ROOT
from build.wheelhouse import Resolution, Wheel
from contracts.events import EventLog
from tests.fakes.engine import FakeEngine

pytestmark = pytest.mark.unit
QUIET = EventLog(quiet=True)


def passing_checks(image, command, **kwargs) -> RunResult:
    rows = [{"subject": "image", "check": "lock", "status": "PASS", "detail": "", "fix": ""}]
    return RunResult(0, "FTIMAGE-CHECK " + json.dumps(rows))


def engine_with_bases(plan) -> FakeEngine:
    engine = FakeEngine(on_run=passing_checks)
    for ref in (plan.spec.builder_base, plan.spec.runtime_base):
        base = ref.bootstrap
        engine.images[base_tag(base)] = {"Id": "sha256:" + "b" * 64, "Size": 1, "RepoTags": [base_tag(base)],
                                         "Config": {"Labels": {SPEC_LABEL: digest(base.spec_dict())}}}
    return engine


@pytest.fixture
def smoke(tmp_path, monkeypatch):
    """The smoke plan, a cache holding stand-in wheels, and a wheelhouse stage that returns them."""
    return smoke_with_stand_in_wheels(tmp_path, monkeypatch)


def smoke_with_stand_in_wheels(tmp_path, monkeypatch):
    """(the smoke plan, a cache under tmp_path holding stand-in torch and transformers wheels, the
    out folder), with the wheelhouse stage patched to return those wheels."""
    plan = load_plan(REPO_ROOT / "images" / "smoke")
    cache = CacheLayout(tmp_path / "cache")
    wheels = []
    for name in ("torch", "transformers"):
        filename = f"{name}-1.0-py3-none-any.whl"
        sha = hashlib.sha256(name.encode()).hexdigest()
        path = cache.wheel_path(sha, filename)
        path.parent.mkdir(parents=True)
        path.write_bytes(name.encode())
        wheels.append(Wheel(name=name, version="1.0", filename=filename, sha256=sha))
    monkeypatch.setattr(pipeline, "fill_wheelhouse",
                        lambda plan, cache, log, remote=None: Resolution(key="r", wheels=tuple(wheels), cache_hit=True))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    return plan, cache, tmp_path / "out"


def test_second_build_of_the_same_context_is_an_image_cache_hit(smoke):
    plan, cache, out = smoke
    engine = engine_with_bases(plan)
    first = pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    assert first.cache["image"] == "miss" and engine.count("build") == 1
    second = pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    assert second.cache["image"] == "hit" and engine.count("build") == 1
    assert second.image_id == first.image_id and second.cache["base:runtime"] == "hit"
    labels = engine.images[plan.tag]["Config"]["Labels"]
    assert labels["io.ftimage.plan-key"] == plan.plan_key and labels[pipeline.LOCK_LABEL] == first.lock_sha256
    assert (out / "build-report.json").is_file() and (out / "context" / "Dockerfile").is_file()


def test_a_changed_context_rebuilds_and_prunes_the_superseded_image(smoke, monkeypatch):
    plan, cache, out = smoke
    engine = engine_with_bases(plan)
    pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    old_id = engine.images[plan.tag]["Id"]
    engine.images["smoke:000000000000"] = {**engine.images[plan.tag], "RepoTags": ["smoke:000000000000"]}
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1800000000")   # new labels -> a new context
    report = pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    assert report.cache["image"] == "miss" and engine.count("build") == 2
    assert engine.images[plan.tag]["Id"] != old_id
    assert "smoke:000000000000" in report.pruned and "smoke:000000000000" not in engine.images


def test_prune_removes_untagged_rebuilds_and_older_builder_stages(smoke):
    plan, cache, out = smoke
    engine = engine_with_bases(plan)
    name = plan.spec.name
    # a same-tag rebuild leaves the old image untagged; multi-stage builds leave builder stages
    engine.images["old-untagged"] = {"Id": "sha256:" + "1" * 64, "RepoTags": ["<none>:<none>"], "Created": 1,
                                     "Config": {"Labels": {pipeline.IMAGE_LABEL: name}}}
    for n, created in ((2, 2), (3, 3)):
        engine.images[f"stage-{n}"] = {"Id": "sha256:" + str(n) * 64, "RepoTags": ["<none>:<none>"],
                                       "Created": created, "Config": {"Labels": {
                                           pipeline.IMAGE_LABEL: name, pipeline.STAGE_LABEL: "builder"}}}
    engine.images["other-image-stage"] = {"Id": "sha256:" + "4" * 64, "RepoTags": ["<none>:<none>"], "Created": 0,
                                          "Config": {"Labels": {pipeline.IMAGE_LABEL: "other",
                                                                pipeline.STAGE_LABEL: "builder"}}}
    report = pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    assert "old-untagged" not in engine.images and "stage-2" not in engine.images
    assert "stage-3" in engine.images              # the newest builder stage: the next build's cache
    assert "other-image-stage" in engine.images    # another image's: not ours to prune
    assert plan.tag in engine.images and any("builder stage" in p for p in report.pruned)


def _builder_stage(engine, plan, n):
    engine.images[f"stage-{n}"] = {"Id": "sha256:" + str(n) * 64, "RepoTags": ["<none>:<none>"], "Created": n,
                                   "Config": {"Labels": {pipeline.IMAGE_LABEL: plan.spec.name,
                                                         pipeline.STAGE_LABEL: "builder"}}}


def test_a_disk_too_small_for_the_image_fails_before_building(smoke):
    plan, cache, out = smoke
    engine = engine_with_bases(plan)
    _builder_stage(engine, plan, 3)
    engine.free_bytes = 10     # the stand-in wheelhouse is 17 bytes: the image alone needs ~34
    with pytest.raises(BuildFailure) as failure:
        pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    message = failure.value.render()
    assert "not enough disk" in message and "/var/lib/docker" in message and "docker image prune" in message
    assert engine.count("build") == 0
    assert "stage-3" not in engine.images      # its layer cache went first, to make room


def test_a_tight_disk_drops_the_layer_cache_and_builds_with_a_warning(smoke):
    plan, cache, out = smoke
    engine = engine_with_bases(plan)
    _builder_stage(engine, plan, 3)
    engine.free_bytes = 50     # above the image (~34) but under the build's peak (~102)
    stream = io.StringIO()
    report = pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=EventLog(stream=stream),
                                  engine=engine)
    assert engine.count("build") == 1 and "stage-3" not in engine.images
    assert any("builder stage" in p for p in report.pruned)
    assert "may need up to" in stream.getvalue()


def test_a_roomy_disk_keeps_the_layer_cache(smoke):
    plan, cache, out = smoke
    engine = engine_with_bases(plan)
    _builder_stage(engine, plan, 3)
    engine.free_bytes = 10 ** 12
    pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    assert "stage-3" in engine.images


def fake_compile(calls):
    def compile_kernel(kernel, plan, *, cache, engine, log, builder_base, store):
        calls.append(kernel.name)
        staging = store.staging(kernel.key)
        wheel = staging / "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
        wheel.write_bytes(f"wheel {time.monotonic()}".encode())
        meta = {"kernel": kernel.name, "version": kernel.version, "wheel": wheel.name,
                "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(), "inputs": kernel.key_inputs,
                "archs": {"sass": list(kernel.archs), "ptx": []}, "duration_s": 1.0, "created": 1}
        return store.publish(kernel.key, staging, meta)
    return compile_kernel


def test_kernel_stage_compiles_once_then_hits(tmp_path, monkeypatch):
    plan = load_plan(REPO_ROOT / "images" / "kernel-smoke")
    cache = CacheLayout(tmp_path / "cache")
    calls: list[str] = []
    monkeypatch.setattr(kernel_stage, "compile_kernel", fake_compile(calls))
    first = kernel_stage.provide_kernels(plan, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    assert sorted(calls) == ["causal-conv1d", "flash-attn"]
    assert all(state.startswith("miss") for state in first.states.values())
    second = kernel_stage.provide_kernels(plan, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    assert sorted(calls) == ["causal-conv1d", "flash-attn"]          # no compile on a hit
    assert set(second.states.values()) == {"hit local"}
    assert [w.sha256 for w in second.wheels] == [w.sha256 for w in first.wheels]


def test_a_corrupt_kernel_entry_is_named_in_the_plan_then_rebuilt(tmp_path, monkeypatch):
    plan = load_plan(REPO_ROOT / "images" / "kernel-smoke")
    cache = CacheLayout(tmp_path / "cache")
    calls: list[str] = []
    monkeypatch.setattr(kernel_stage, "compile_kernel", fake_compile(calls))
    kernel_stage.provide_kernels(plan, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    conv = next(k for k in plan.kernels if k.name == "causal-conv1d")
    entry = KernelStore(cache).get(conv.key)
    entry.wheel.write_bytes(b"tampered")
    state, _ = kernel_stage.expected_costs(plan, cache)[conv.key]
    assert state.startswith("CORRUPT") and entry.meta["wheel"] in state   # named, not silently deleted
    assert entry.wheel.exists()
    again = kernel_stage.provide_kernels(plan, cache=cache, engine=FakeEngine(), log=QUIET, builder_base="b")
    assert calls.count("causal-conv1d") == 2 and again.states["causal-conv1d"].startswith("miss")
    assert KernelStore(cache).get(conv.key) is not None


def test_concurrent_first_builds_into_one_fresh_out_folder_are_never_refused(tmp_path):
    """Two builds starting at once into the same new out/ folder: neither may see the other's
    half-made folder as foreign."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()

    def build(target: str) -> None:
        from contracts import folder_guard

        try:
            for i in range(50):
                folder_guard.claim(Path(target) / f"img{i}", folder_guard.OUTPUT_MARKER, what="output folder",
                                   option="--out")
            results.put("ok")
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            results.put(f"{type(exc).__name__}: {exc}")

    workers = [ctx.Process(target=build, args=(str(tmp_path / "out"),)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert sorted(results.get(timeout=5) for _ in workers) == ["ok"] * 4
    leftovers = [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []


def test_verify_reproducible_names_untracked_files_a_build_would_copy(tmp_path):
    """Its clones hold only HEAD: an untracked module in an app package would ship in a build of
    this checkout but is not part of the check, so it is named; files a build never copies are not."""
    import subprocess

    from build.audit.reproducible import untracked_build_inputs

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "entrypoint").mkdir()
    (tmp_path / "entrypoint" / "new_module.py").write_text("X = 1\n")
    (tmp_path / "notes.txt").write_text("not copied by a build\n")
    assert untracked_build_inputs(tmp_path) == ["entrypoint/new_module.py"]


def _stand_in_resolver(cache: CacheLayout, *, clashing: str | None = None):
    """resolve_closure as the wheelhouse answers it: the toolchain's wheels, plus one wheel per
    extra requirement; `clashing` names a build requirement whose resolution also picks another
    build of torch."""
    def wheel(name: str, build: str = "") -> Wheel:
        filename = f"{name}-1.0-py3-none-any.whl"
        sha = hashlib.sha256((name + build).encode()).hexdigest()
        path = cache.wheel_path(sha, filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes((name + build).encode())
        return Wheel(name=name, version="1.0", filename=filename, sha256=sha)

    def resolve(requirements, *, plan, cache, log, purpose):
        toolchain = set(plan.toolchain.cuda_pip_toolchain)
        extra = [r.split("==")[0] for r in requirements if r not in toolchain]
        torch = wheel("torch", "other" if clashing in extra else "")
        wheels = (torch, wheel("nvidia-cuda-nvcc")) + tuple(wheel(name) for name in extra)
        return Resolution(key=digest(list(requirements)), wheels=wheels, cache_hit=True)
    return resolve


def test_every_kernel_compiles_in_one_toolchain_builder_with_its_own_requirements_on_top(tmp_path, monkeypatch):
    from build.kernels import compile as compile_module

    plan = load_plan(REPO_ROOT / "images" / "kernel-smoke")
    cache = CacheLayout(tmp_path / "cache")
    monkeypatch.setattr(compile_module, "resolve_closure", _stand_in_resolver(cache))
    engine = FakeEngine()
    found = {k.name: compile_module.builder_for(k, plan, builder_base="base", cache=cache, engine=engine, log=QUIET)
             for k in plan.kernels}
    assert len({image for image, _ in found.values()}) == 1
    assert [c for c in engine.calls if c[0] == "build"] == [("build", found["flash-attn"][0])]   # built once
    for kernel in plan.kernels:
        on_top = [w.name for w in found[kernel.name][1]]
        assert on_top == sorted(r.split("==")[0] for r in kernel.build_requires), kernel.name
    # the compile installs exactly those, hash-locked, from the staged folder
    staged = tmp_path / "in" / "build-requires"
    compile_module.stage_wheels(staged, found["flash-attn"][1], cache)
    lock = (staged / "requirements.txt").read_text().splitlines()
    assert [line.split("==")[0] for line in lock] == [w.name for w in found["flash-attn"][1]]
    assert all("--hash=sha256:" in line for line in lock)
    assert sorted(p.name for p in staged.glob("*.whl")) == sorted(w.filename for w in found["flash-attn"][1])


def test_a_kernel_whose_requirements_change_the_toolchain_gets_a_builder_of_its_own(tmp_path, monkeypatch):
    from build.kernels import compile as compile_module

    plan = load_plan(REPO_ROOT / "images" / "kernel-smoke")
    cache = CacheLayout(tmp_path / "cache")
    monkeypatch.setattr(compile_module, "resolve_closure", _stand_in_resolver(cache, clashing="einops"))
    engine = FakeEngine()
    found = {k.name: compile_module.builder_for(k, plan, builder_base="base", cache=cache, engine=engine, log=QUIET)
             for k in plan.kernels}
    assert found["flash-attn"][0] != found["causal-conv1d"][0]
    assert found["flash-attn"][1] == ()                 # everything is in its own image
    assert [w.name for w in found["causal-conv1d"][1]] == ["ninja", "packaging", "wheel"]


# ---- build_and_publish: the one library call behind `python -m build IMAGE_DIR` -------------------

class RecordingRemote:
    """A remote cache that records what the pipeline asks of it."""

    def __init__(self, calls: list, registry: str):
        self.calls = calls
        self.options = type("Options", (), {"registry": registry})()

    def flush(self, *, mount_from: str = "") -> None:
        self.calls.append(("flush", mount_from))

    def record(self) -> dict:
        return {"flushed": True}


@pytest.mark.parametrize("cache_registry, mount_from", [("127.0.0.1:5000", "team/smoke"), ("other:5000", "")])
def test_build_and_publish_pushes_then_flushes_then_writes_the_report_once(tmp_path, monkeypatch, cache_registry,
                                                                             mount_from):
    """Push first, then the remote cache's flush (which mounts the blobs the push stored when both
    are in one registry), then one report write with what the flush did."""
    from build.build_report import BuildReport
    from build.publish.reference import PushTarget

    calls: list = []
    plan = load_plan(REPO_ROOT / "images" / "smoke")

    def fake_build_image(plan, **kwargs):
        calls.append(("build", kwargs["remote"] is remote, kwargs["write_report"]))
        return BuildReport(image="smoke", tag=plan.tag)

    def fake_push(report, target, **kwargs):
        calls.append(("push", target.repository, kwargs["sign_key"], kwargs["out_dir"]))
        report.pushed = {"reference": f"{target.repository}@sha256:{'0' * 64}"}

    written: list[dict] = []
    monkeypatch.setattr(pipeline, "build_image", fake_build_image)
    monkeypatch.setattr(pipeline, "push_image", fake_push)
    monkeypatch.setattr(pipeline.atomic, "write_text",
                        lambda path, text: (calls.append(("write", Path(path).name)), written.append(json.loads(text))))
    remote = RecordingRemote(calls, cache_registry)
    report = pipeline.build_and_publish(plan, cache=CacheLayout(tmp_path / "cache"), out_dir=tmp_path / "out",
                                        log=QUIET, remote=remote, sign_key="KEY",
                                        push_target=PushTarget("127.0.0.1:5000", "team/smoke"))
    assert calls == [("build", True, False), ("push", "127.0.0.1:5000/team/smoke", "KEY", None),
                     ("flush", mount_from), ("write", "build-report.json")]
    assert written[-1]["remote_cache"] == {"flushed": True} and written[-1]["pushed"] == report.pushed


def test_build_and_publish_without_a_push_or_remote_cache_is_the_build_and_one_report(tmp_path, monkeypatch):
    from build.build_report import BuildReport

    plan = load_plan(REPO_ROOT / "images" / "smoke")
    built = BuildReport(image="smoke", tag=plan.tag)
    writes: list[str] = []
    monkeypatch.setattr(pipeline, "build_image", lambda plan, **kwargs: built)
    monkeypatch.setattr(pipeline, "push_image", lambda *a, **k: pytest.fail("pushed without --push"))
    monkeypatch.setattr(pipeline.atomic, "write_text", lambda path, text: writes.append(Path(path).name))
    assert pipeline.build_and_publish(plan, cache=CacheLayout(tmp_path / "cache"), out_dir=tmp_path / "out",
                                      log=QUIET) is built
    assert writes == ["build-report.json"]


def test_a_failed_push_still_leaves_the_report_of_the_built_image(tmp_path, monkeypatch):
    from build.build_report import BuildReport
    from build.publish.reference import PushTarget

    plan = load_plan(REPO_ROOT / "images" / "smoke")
    monkeypatch.setattr(pipeline, "build_image", lambda plan, **kwargs: BuildReport(image="smoke", tag=plan.tag))

    def failing_push(*args, **kwargs):
        raise BuildFailure("push to 127.0.0.1:5000 failed: connection refused", "start the registry")

    monkeypatch.setattr(pipeline, "push_image", failing_push)
    with pytest.raises(BuildFailure, match="connection refused"):
        pipeline.build_and_publish(plan, cache=CacheLayout(tmp_path / "cache"), out_dir=tmp_path / "out", log=QUIET,
                                   push_target=PushTarget("127.0.0.1:5000", "team/smoke"))
    saved = json.loads((tmp_path / "out" / "build-report.json").read_text())
    assert saved["image"] == "smoke" and saved["pushed"] == {}


def test_the_build_command_parses_and_hands_the_build_to_the_pipeline(tmp_path, monkeypatch, capsys):
    """`build_command.main` checks the flags and dispatches: the build, push, flush and report are
    the pipeline's (one call)."""
    from build.build_report import BuildReport
    from build.cli import build_command

    seen = {}

    def fake_build_and_publish(plan, **kwargs):
        seen.update(kwargs, image=plan.spec.name)
        return BuildReport(image=plan.spec.name, tag=plan.tag)

    monkeypatch.setattr(pipeline, "build_and_publish", fake_build_and_publish)
    code = build_command.main(["images/smoke", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"),
                               "--push", "127.0.0.1:5000/team/smoke", "--json"])
    assert code == 0 and seen["image"] == "smoke" and seen["push_target"].path == "team/smoke"
    assert seen["remote"] is None and seen["sign_key"] is None and seen["out_dir"] == tmp_path / "out"
    assert json.loads(capsys.readouterr().out)["image"] == "smoke"


@pytest.mark.parametrize("argv, words", [
    (["verify-reproducible", "/tmp"], "is not an image folder of this checkout"),
    (["verify-reproducible", "images/smoke", "--push-to", "team/smoke"], "names no registry"),
])
def test_verify_reproducible_refuses_bad_arguments_before_any_build(run_cli, monkeypatch, argv, words):
    from build.audit import reproducible

    monkeypatch.setattr(reproducible, "_clone", lambda *a, **k: pytest.fail("cloned despite a bad argument"))
    code, out, err = run_cli(argv)
    assert code == 2 and words in err and "Traceback" not in err, err
