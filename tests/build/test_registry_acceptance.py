"""A registry cache entry is trusted for what it holds, not for what it claims: a signed entry is
checked against its key's own inputs (the plan's) before it enters the local cache (the wheel's
own SASS/PTX, tags, dist-info, the torch and CUDA it recorded), and in the image's check stage
before the build succeeds; one that fails either is evicted, named in a WARN and compiled
instead. `--plan` checks what it can without the wheel and never says `hit registry`. The
acceptance function itself is fuzzed: an entry whose meta.json and wheel disagree in any field
is never accepted, and one that matches its key's inputs always is."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import build.kernels as kernel_stage
from build import pipeline
from build.cache import CacheLayout
from build.engine import RunResult
from build.kernels.acceptance import Expected, meta_problems
from build.kernels.portable import prove_entry
from build.kernels.store import KernelStore
from build.remote_cache import wire
from build.resolve import digest, load_plan, resolve
from build.resolve.this_host import with_archs
from build.spec import REPO_ROOT, load_image_spec, load_manifest
from contracts.events import EventLog
from tests.build import kernel_wheels
from tests.build.test_pipeline_logic import engine_with_bases, fake_compile, smoke_with_stand_in_wheels
from tests.build.test_remote_cache import _push_raw, leftovers, remote

pytestmark = pytest.mark.unit
KERNEL_SMOKE = REPO_ROOT / "images" / "kernel-smoke"


def plan_for(archs: tuple[str, ...]):
    """kernel-smoke's plan for other target archs (its kernels get other keys)."""
    manifest = load_manifest(REPO_ROOT / "kernels_manifest.yaml")
    return resolve(with_archs(load_image_spec(KERNEL_SMOKE), archs), manifest)


def push_entry(address: str, repo: str, key: str, wheel: Path, meta: dict, sign_key) -> None:
    """An entry stored as a runner pushes one, signed: `wheel` and `meta` as given, under `key`."""
    meta_bytes = json.dumps(meta).encode()
    layers = [wire.Descriptor.of(wire.WHEEL_MEDIA, wheel.read_bytes(), {wire.TITLE: wheel.name}),
              wire.Descriptor.of(wire.KERNEL_META_MEDIA, meta_bytes)]
    _push_raw(address, repo, f"kernel-{key}", wire.build_manifest(wire.KERNEL_ARTIFACT, layers),
              [wheel.read_bytes(), meta_bytes], sign_key)


# ---- the poisoned entry: meta.json says key B (sm_100), the wheel is key A's (sm_90) ------------

def test_a_signed_entry_whose_wheel_is_another_keys_is_evicted_named_and_compiled(registry, keys, tmp_path,
                                                                                  monkeypatch):
    plan_a, plan_b = plan_for(("sm_90",)), plan_for(("sm_100",))
    conv_a = next(k for k in plan_a.kernels if k.name == "causal-conv1d")
    conv_b = next(k for k in plan_b.kernels if k.name == "causal-conv1d")
    assert conv_a.key != conv_b.key
    entry_a = kernel_wheels.publish(KernelStore(CacheLayout(tmp_path / "runner-a")), conv_a.key_inputs)
    poisoned = {**kernel_wheels.entry_meta(conv_b.key_inputs, entry_a.wheel), "key": conv_b.key}
    assert poisoned["archs"]["sass"] == ["sm_100"] and poisoned["sha256"] == entry_a.sha256
    push_entry(registry.address, "team/poisoned", conv_b.key, entry_a.wheel, poisoned, keys["signer"][0])

    # --plan: meta.json is consistent with key B, so it cannot refuse it; it says it is unchecked
    planner = remote(registry.address, "team/poisoned", public=keys["signer"][1])
    state = planner.kernel_state(Expected.of(conv_b, plan_b.toolchain))
    assert state.startswith("in registry, not yet checked") and "hit registry" not in state
    costs = kernel_stage.expected_costs(plan_b, CacheLayout(tmp_path / "plan-cache"), planner.kernel_state)
    assert costs[conv_b.key][0].startswith("in registry, not yet checked")

    # the build: refused before it enters the local cache, named, compiled instead
    calls: list[str] = []
    monkeypatch.setattr(kernel_stage, "compile_kernel", fake_compile(calls))
    reader = remote(registry.address, "team/poisoned", public=keys["signer"][1])
    cache = CacheLayout(tmp_path / "runner-b")
    provided = kernel_stage.provide_kernels(plan_b, cache=cache, engine=None, log=EventLog(quiet=True),
                                            builder_base="b", remote=reader.fetch_kernel)
    assert provided.states["causal-conv1d"].startswith("miss (compiled") and "causal-conv1d" in calls
    (warning,) = reader.test_log.warnings()
    assert f"kernel-{conv_b.key}" in warning and "compiling it here instead" in warning
    assert "wanted sm_100; wheel has SASS sm_90" in warning
    entry = KernelStore(cache).get(conv_b.key)
    assert entry is not None and "fetched_from" not in entry.meta        # the compiled one, not the fetched one
    assert leftovers(tmp_path / "runner-b") == [] and reader.record()["hits"] == 0
    assert f"kernel-{conv_b.key}" in reader.record()["refused"]


# ---- the in-image step: the image's check stage runs for every kernel wheel, fetched or compiled --

def test_a_fetched_wheel_failing_the_in_image_checks_is_evicted_and_the_build_compiles_it(
        registry, keys, tmp_path, monkeypatch):
    _, cache, out = smoke_with_stand_in_wheels(tmp_path, monkeypatch)
    plan = load_plan(KERNEL_SMOKE)
    conv = next(k for k in plan.kernels if k.name == "causal-conv1d")
    source = KernelStore(CacheLayout(tmp_path / "elsewhere"))
    writer = remote(registry.address, "team/incontainer", sign=keys["signer"][0])
    for kernel in plan.kernels:
        writer.queue_kernel(kernel_wheels.publish(source, kernel.key_inputs))
    writer.flush()

    checked: list[list[str]] = []

    def image_checks(image, command, **kwargs) -> RunResult:
        """The in-image check script's answer: causal-conv1d's fetched wheel does not import."""
        config = json.loads(command[-1])
        checked.append([k["name"] for k in config["kernels"]])
        rows = [{"subject": "image", "check": "lock", "status": "PASS", "detail": "", "fix": ""},
                {"subject": "torch", "check": "version", "status": "PASS", "detail": "", "fix": ""}]
        for name in checked[-1]:
            bad = name == "causal-conv1d" and len(checked) == 1
            rows.append({"subject": name, "check": "import/ABI", "status": "FAIL" if bad else "PASS",
                         "detail": "undefined symbol _ZN3c104cuda9SetDeviceEi" if bad else "", "fix": ""})
        return RunResult(0, "FTIMAGE-CHECK " + json.dumps(rows))

    engine = engine_with_bases(plan)
    engine.on_run = image_checks
    calls: list[str] = []
    monkeypatch.setattr(kernel_stage, "compile_kernel", fake_compile(calls))
    reader = remote(registry.address, "team/incontainer", public=keys["signer"][1])
    report = pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=EventLog(quiet=True),
                                  engine=engine, remote=reader)
    # every kernel wheel, both fetched, went through the image's check stage; then again after the compile
    assert checked == [["causal-conv1d", "flash-attn"]] * 2
    assert calls == ["causal-conv1d"]
    assert report.cache["kernel:causal-conv1d"].startswith("miss (compiled")
    assert report.cache["kernel:flash-attn"] == "hit local"            # fetched by the first pass, and sound
    (warning,) = reader.test_log.warnings()
    assert f"kernel-{conv.key}" in warning and "failed the in-image checks" in warning
    assert "undefined symbol" in warning and "evicted from the local cache, compiling it here instead" in warning
    entry = KernelStore(cache).get(conv.key)
    assert entry is not None and "fetched_from" not in entry.meta
    (why,) = report.remote_cache["refused"].values()
    assert list(report.remote_cache["refused"]) == [f"kernel-{conv.key}"] and "in-image checks" in why


def test_an_in_image_failure_of_a_compiled_wheel_still_fails_the_build(tmp_path, monkeypatch):
    from build.errors import BuildFailure

    _, cache, out = smoke_with_stand_in_wheels(tmp_path, monkeypatch)
    plan = load_plan(KERNEL_SMOKE)

    def failing(image, command, **kwargs) -> RunResult:
        rows = [{"subject": "causal-conv1d", "check": "import/ABI", "status": "FAIL", "detail": "no", "fix": "f"}]
        return RunResult(0, "FTIMAGE-CHECK " + json.dumps(rows))

    engine = engine_with_bases(plan)
    engine.on_run = failing
    calls: list[str] = []
    monkeypatch.setattr(kernel_stage, "compile_kernel", fake_compile(calls))
    with pytest.raises(BuildFailure, match="not sound"):
        pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=EventLog(quiet=True),
                             engine=engine)
    assert sorted(calls) == ["causal-conv1d", "flash-attn"]       # once: nothing fetched, nothing evicted
    assert KernelStore(cache).get(next(k.key for k in plan.kernels if k.name == "causal-conv1d")) is not None


# ---- the acceptance function, fuzzed -------------------------------------------------------------

ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")
archs = st.lists(st.sampled_from(ARCHS), min_size=1, max_size=4, unique=True).map(lambda a: tuple(sorted(a)))
ptx = st.lists(st.sampled_from(ARCHS), max_size=2, unique=True).map(tuple)
GOOD_TAGS = ("cp311-cp311-linux_x86_64", "cp311-cp311-manylinux_2_28_x86_64", "cp311-abi3-linux_x86_64",
             "cp39-abi3-manylinux2014_x86_64")


def build_entry(root: Path, inputs: dict, *, wheel: dict, meta: dict, key: str | None = None) -> tuple[Path, str]:
    """An entry folder for `inputs` whose wheel and meta.json take the given overrides."""
    key = key or digest(inputs)
    directory = root / key
    directory.mkdir(parents=True)
    made = kernel_wheels.write_wheel(directory, inputs["kernel"], inputs["version"],
                                     **{"sass": inputs["archs"], **wheel})
    (directory / "build.log").write_bytes(kernel_wheels.BUILD_LOG)
    report_ptx = wheel.get("ptx", ())
    body = {**kernel_wheels.entry_meta(inputs, made, ptx=report_ptx), "key": key}
    for field, value in meta.items():
        if field in ("sass", "ptx"):
            body["archs"] = {**body["archs"], field: list(value)}
        elif field in ("torch", "torch_cuda", "nvcc"):
            body["observed"] = {**body["observed"], field: value}
        else:
            body[field] = value
    (directory / "meta.json").write_text(json.dumps(body))
    return directory, key


def disagreement(field: str, inputs: dict, draw) -> tuple[dict, dict, str | None]:
    """(wheel overrides, meta.json overrides, another key) that make one field disagree."""
    other = lambda values, current: draw(st.sampled_from([v for v in values if v != current]))  # noqa: E731
    side = draw(st.sampled_from(["file", "held"]))
    if field == "key":
        if draw(st.booleans()):      # meta.json of another key: its inputs with other archs
            moved = {**inputs, "archs": list(draw(archs.filter(lambda a: list(a) != inputs["archs"])))}
            return {}, {"inputs": moved, "key": digest(moved)}, None
        return {}, {"key": draw(st.text("0123456789abcdef", min_size=64, max_size=64))}, None
    if field == "sass":
        wrong = draw(archs.filter(lambda a: list(a) != inputs["archs"]))
        return ({"sass": wrong}, {}, None) if side == "file" else ({}, {"sass": wrong}, None)
    if field == "ptx":
        held = draw(ptx)
        return {"ptx": held}, {"ptx": draw(ptx.filter(lambda p: sorted(p) != sorted(held)))}, None
    if field in ("python", "abi", "platform"):
        python, abi, platform = "cp311", "cp311", "linux_x86_64"
        if field == "python":
            python = other(("cp310", "cp312", "cp313", "py3", "pp311"), "")
        elif field == "abi":
            abi = other(("cp312", "cp311d", "none", "abi4", "cp310"), "")
        else:
            platform = other(("linux_aarch64", "manylinux_2_28_aarch64", "win_amd64", "any", "macosx_14_0_arm64"), "")
        tag = f"{python}-{abi}-{platform}"
        if side == "file":
            return {"tag": tag}, {"wheel": kernel_wheels.wheel_name(inputs["kernel"], inputs["version"], tag)}, None
        return {"held_tag": tag}, {}, None
    if field == "torch":
        return {}, {"torch": other(("2.13.0+cu130", "2.15.0", "2.14.0", "2.14.2+cu130"), "")}, None
    if field == "cuda":
        return {}, {draw(st.sampled_from(["torch_cuda", "nvcc"])): other(("12.8", "13.1", "None", "12.9"), "")}, None
    if field == "version":
        wrong = other(("1.7.1", "1.6.0", "2.0.0"), inputs["version"])
        where = draw(st.sampled_from(["file", "held", "meta"]))
        if where == "file":
            return {"name": kernel_wheels.wheel_name(inputs["kernel"], wrong), "held_version": inputs["version"]}, \
                {"wheel": kernel_wheels.wheel_name(inputs["kernel"], wrong)}, None
        return ({"held_version": wrong}, {}, None) if where == "held" else ({}, {"version": wrong}, None)
    assert field == "sha256"
    return {}, {"sha256": draw(st.text("0123456789abcdef", min_size=64, max_size=64))}, None


FIELDS = ("key", "sass", "ptx", "python", "abi", "platform", "torch", "cuda", "version", "sha256")


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(FIELDS), wanted=archs, data=st.data())
def test_an_entry_whose_meta_and_wheel_disagree_in_any_field_is_never_accepted(field, wanted, data):
    inputs = kernel_wheels.key_inputs(archs=wanted)
    wheel, meta, key = disagreement(field, inputs, data.draw)
    with tempfile.TemporaryDirectory() as root:
        directory, key = build_entry(Path(root), inputs, wheel=wheel, meta=meta, key=key)
        with pytest.raises(ValueError):
            prove_entry(directory, digest(inputs), Expected(digest(inputs), inputs, kernel_wheels.TORCH))


@settings(max_examples=200, deadline=None)
@given(wanted=archs, held_ptx=ptx, tag=st.sampled_from(GOOD_TAGS),
       torch=st.sampled_from(["2.14.1", "2.14.1+cu130"]), version=st.sampled_from(["1.7.0", "2.8.3.post2"]))
def test_an_entry_whose_wheel_and_meta_match_the_keys_inputs_is_accepted(wanted, held_ptx, tag, torch, version):
    inputs = kernel_wheels.key_inputs(version=version, archs=wanted)
    expected = Expected(digest(inputs), inputs, "2.14.1")
    with tempfile.TemporaryDirectory() as root:
        directory, key = build_entry(Path(root), inputs, wheel={"ptx": held_ptx, "tag": tag},
                                     meta={"wheel": kernel_wheels.wheel_name("causal-conv1d", version, tag),
                                           "torch": torch})
        meta = json.loads((directory / "meta.json").read_text())
        assert meta_problems(meta, expected) == []
        assert prove_entry(directory, key, expected).key == key
