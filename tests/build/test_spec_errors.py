"""Broken specs exit 2 with a message that names the file, the field and the fix; never a traceback."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

# a requirement the tests append lands after the shipped qwen27b spec's own ones
QWEN27B = Path(__file__).resolve().parents[2] / "images" / "qwen27b" / "image.yaml"
APPENDED = len(yaml.safe_load(QWEN27B.read_text())["python"]["requirements"])


def _image_edit(fn):
    def apply(ws):
        data = ws.load("qwen27b")
        fn(data)
        ws.save("qwen27b", data)
    return apply


def _manifest_edit(fn):
    def apply(ws):
        data = ws.load_manifest()
        fn(data)
        ws.save_manifest(data)
    return apply


def _malformed_image(ws):
    (ws.image("qwen27b") / "image.yaml").write_text("name: qwen27b\nbases: {builder: [unclosed\n")


def _malformed_manifest(ws):
    ws.manifest.write_text("toolchains:\n  a: b\n c: d\n")


TC = "cu130-torch2.14.1-py311"

BROKEN = {
    # name: (mutation, field expected in the message, code-ish word expected in the message)
    "malformed image yaml": (_malformed_image, "(file)", "malformed YAML"),
    "malformed manifest yaml": (_malformed_manifest, "(file)", "malformed YAML"),
    "missing field": (_image_edit(lambda d: d.pop("toolchain")), "toolchain", "required field is missing"),
    "unknown kernel": (_image_edit(lambda d: d["kernels"].append("flash-attn-4")), "kernels[3]",
                       "unknown kernel 'flash-attn-4'"),
    "unknown arch": (_image_edit(lambda d: d["target_archs"].append("sm_99")), "target_archs[2]",
                     "unknown arch 'sm_99'"),
    "malformed arch": (_image_edit(lambda d: d.update(target_archs=["hopper"])), "target_archs[0]",
                       "is not an arch name"),
    "arch the CUDA cannot target": (_image_edit(lambda d: d.update(target_archs=["sm_70"], kernels=[])),
                                    "target_archs[0]", "needs CUDA >= 9.0 and <= 12.9"),
    "torch and CUDA mismatch": (_manifest_edit(lambda m: m["toolchains"][TC].update(cuda="12.4")),
                                f"toolchains.{TC}.cuda", "ships no build for CUDA 12.4"),
    "python outside a kernel's range": (
        _manifest_edit(lambda m: m["kernels"]["causal-conv1d"]["constraints"].update(python=">=3.12")),
        "kernels[1]", "needs python >=3.12"),
    "missing sha256": (_manifest_edit(lambda m: m["toolchains"][TC]["torch"]["wheels"]["linux_x86_64"].pop("sha256")),
                       f"toolchains.{TC}.torch.wheels.linux_x86_64.sha256", "required field is missing"),
    "sha256 of the wrong length": (
        _manifest_edit(lambda m: m["kernels"]["causal-conv1d"]["source"]["sdist"].update(sha256="abc123")),
        "kernels.causal-conv1d.source.sdist.sha256", "not a sha256"),
    "duplicate kernel": (_image_edit(lambda d: d["kernels"].append("causal-conv1d")), "kernels[3]",
                         "listed twice"),
    "path outside the image folder": (
        _image_edit(lambda d: d.update(finetune={"config_file": "../smoke/finetune.yaml"})),
        "finetune.config_file", "points outside the image folder"),
    "NUL in a file name": (
        _image_edit(lambda d: d.update(finetune={"config_file": "a\x00b"})),
        "finetune.config_file", "control characters"),
    "unknown toolchain": (_image_edit(lambda d: d.update(toolchain="cu999")), "toolchain", "unknown toolchain"),
    "root runtime user": (_image_edit(lambda d: d["runtime"].update(uid=0)), "runtime.uid", "root"),
    "unpinned python requirement": (
        _image_edit(lambda d: d["python"]["requirements"].append("accelerate>=1.0")),
        f"python.requirements[{APPENDED}]", "not pinned to one exact version"),
    "torch in python requirements": (
        _image_edit(lambda d: d["python"]["requirements"].append("torch==2.14.1")),
        f"python.requirements[{APPENDED}]", "torch is set by the toolchain"),
    "GPU archs on a CPU toolchain": (
        _image_edit(lambda d: d.update(toolchain="cpu-torch2.13.0-py311", kernels=[],
                                       runtime={"user": "trainer", "uid": 10001})),
        "target_archs", "CPU-only"),
    "kernel on a CPU toolchain": (
        _image_edit(lambda d: d.update(toolchain="cpu-torch2.13.0-py311", target_archs=[],
                                       runtime={"user": "trainer", "uid": 10001})),
        "kernels[0]", "needs CUDA"),
    "unquoted version number": (_manifest_edit(lambda m: m["toolchains"][TC].update(python=3.11)),
                                f"toolchains.{TC}.python", 'quote it'),
    "unknown field (typo)": (_image_edit(lambda d: d.update(target_arch=["sm_90"])), "target_arch",
                             "unknown field"),
    "tampered patch file pin": (
        _manifest_edit(lambda m: m["kernels"]["flash-attn"]["patches"][0].update(sha256="0" * 64)),
        "kernels.flash-attn.patches", "the manifest pins 0000000000000000"),
    "prebuilt wheel for a compiled kernel": (
        _manifest_edit(lambda m: m["kernels"]["causal-conv1d"].update(source={"wheels": [
            {"filename": "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl", "sha256": "a" * 64,
             "url": "https://example.invalid/causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"}]})),
        "kernels.causal-conv1d.source.wheels", "must be built from its sdist"),
    "flash_attention_2 without flash-attn": (
        _image_edit(lambda d: d.update(kernels=["causal-conv1d"])), "runtime.attn_implementation",
        "needs the flash-attn kernel"),
    "secret in a label": (_image_edit(lambda d: d["labels"].update({"hf_token": "".join(["hf_", "x" * 34])})),
                          "labels.hf_token", "secret"),
    "registry base without tag or digest": (
        _image_edit(lambda d: d["bases"].update(runtime={"image": "nvidia/cuda"})), "bases.runtime.image",
        "neither a tag nor a digest"),
    "unknown bootstrap base": (_image_edit(lambda d: d["bases"].update(builder={"bootstrap": "alpine"})),
                               "bases.builder.bootstrap", "no bootstrap base named 'alpine'"),
    "kernel cannot target an arch": (_image_edit(lambda d: d.update(target_archs=["sm_90", "sm_89"])),
                                     "kernels[0]", "flash-attn 2.8.3.post2 cannot be built for sm_89"),
    "http (not https) source url": (
        _manifest_edit(lambda m: m["kernels"]["causal-conv1d"]["source"]["sdist"].update(
            url="http://files.pythonhosted.org/causal_conv1d-1.7.0.tar.gz")),
        "kernels.causal-conv1d.source.sdist.url", "only https URLs"),
}


@pytest.mark.parametrize("case", sorted(BROKEN), ids=lambda c: c.replace(" ", "-"))
def test_broken_spec_exits_2_naming_field_and_fix(case, ws, run_cli):
    mutate, field, words = BROKEN[case]
    mutate(ws)
    code, out, err = run_cli(ws.plan("qwen27b"))
    assert code == 2, err
    assert "Traceback" not in err + out
    assert f": {field}: " in err, err
    assert words in err, err
    assert "fix: " in err


def test_all_problems_are_reported_together(ws, run_cli):
    data = ws.load("qwen27b")
    data["target_archs"] = ["sm_99"]
    data["runtime"]["uid"] = 0
    data["python"]["requirements"].append("numpy")
    ws.save("qwen27b", data)
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2
    assert "3 problem(s)" in err
    for field in ("target_archs[0]", "runtime.uid", f"python.requirements[{APPENDED}]"):
        assert f": {field}: " in err


def test_shipped_specs_are_valid(ws, run_cli):
    for name in ("smoke", "qwen27b", "kernel-smoke"):
        code, out, err = run_cli(ws.plan(name))
        assert code == 0, err
        assert f"image      {name}" in out


def test_cli_subprocess_has_no_traceback_and_exit_2(ws, tmp_path):
    import subprocess
    import sys

    from build.spec import REPO_ROOT
    _malformed_image(ws)
    proc = subprocess.run([sys.executable, "-m", "build", *ws.plan("qwen27b")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "malformed YAML at line" in proc.stderr


def test_missing_image_folder_is_a_spec_error(ws, run_cli):
    code, _, err = run_cli([str(ws.root / "images" / "nope"), "--plan", "--manifest", str(ws.manifest)])
    assert code == 2
    assert "image spec not found" in err


def test_unknown_kernel_message_lists_known_ones(ws, run_cli):
    data = copy.deepcopy(ws.load("qwen27b"))
    data["kernels"] = ["flash-attn", "mamba-ssm2", "causal-conv1d", "flash-linear-attention"]
    ws.save("qwen27b", data)
    _, _, err = run_cli(ws.plan("qwen27b"))
    assert "unknown kernel 'mamba-ssm2'" in err
    assert "use one of: causal-conv1d, flash-attn, flash-linear-attention, mamba-ssm" in err


def test_finetune_defaults_are_validated_with_the_entrypoint_schema(ws, run_cli):
    (ws.image("smoke") / "finetune.yaml").write_text("packing: {mode: zigzag}\ntrian: {max_steps: 3}\n")
    code, _, err = run_cli(ws.plan("smoke"))
    assert code == 2
    # reported against the file they are in (finetune.yaml), not against image.yaml
    assert "finetune.yaml: packing.mode: " in err
    assert "finetune.yaml: trian: " in err and "did you mean `train`" in err
    assert "image.yaml: finetune" not in err


def test_one_cause_one_error_no_follow_ons(ws, run_cli):
    manifest = ws.load_manifest()
    manifest["kernels"]["causal-conv1d"]["source"]["sdist"]["sha256"] = "abc123"
    ws.save_manifest(manifest)
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2 and "1 problem(s)" in err and "sdist.sha256" in err
    assert "unknown kernel" not in err
    ws.manifest.unlink()
    code, _, err = run_cli(ws.plan("qwen27b"))
    assert code == 2 and "kernels manifest not found" in err and "(none)" not in err and "1 problem(s)" in err


def test_image_yaml_keys_get_did_you_mean(ws, run_cli):
    text = (ws.image("smoke") / "image.yaml").read_text().replace("toolchain:", "toolchan:")
    (ws.image("smoke") / "image.yaml").write_text(text)
    code, _, err = run_cli(ws.plan("smoke"))
    assert code == 2 and "toolchan: unknown field" in err and "did you mean `toolchain`?" in err
