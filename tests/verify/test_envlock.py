import hashlib
import importlib.metadata
import json

import pytest

from verify import envlock
from verify.lock import load_lock

pytestmark = pytest.mark.unit


def test_envlock_records_installed_kernels_with_their_wheel_sha256(tmp_path, monkeypatch):
    wheel = tmp_path / "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    real_version = importlib.metadata.version

    def version(name):
        return "1.7.0" if name == "causal-conv1d" else real_version(name)
    monkeypatch.setattr(envlock.importlib.metadata, "version", version)
    out = tmp_path / "lock.json"
    assert envlock.main(["--out", str(out), "--wheel", f"causal-conv1d={wheel}", "--arch", "sm_90"]) == 0
    lock = load_lock(out)
    (kernel,) = lock.kernels
    assert kernel.name == "causal-conv1d" and kernel.replaces == ("causal_conv1d_fn",)
    assert kernel.sha256 == hashlib.sha256(wheel.read_bytes()).hexdigest() and kernel.wheel == wheel.name
    assert lock.target_archs == ("sm_90",)
    assert lock.attn_implementation == "sdpa"          # no flash-attn here: the lock must not promise it
    assert json.loads(out.read_text())["model_family"] == "qwen3_5_text"
