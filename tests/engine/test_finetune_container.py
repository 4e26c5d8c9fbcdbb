"""Engine tier: `docker run --network none <smoke image> finetune --allow-fallback ...` end to end."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fixtures.chat import write_fixture

pytestmark = pytest.mark.engine


def _open_for_uid(root: Path) -> None:
    """The image runs as uid 10001; let it write the mounted volume (as a cluster PVC would)."""
    for path in [root, *root.rglob("*")]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)


def test_finetune_in_container_with_override_on_record(engine, smoke_image, tmp_path):
    fx = write_fixture(tmp_path / "fx", n_rows=96, mount_root="/fx",
                       config_overrides={"train.max_steps": 6, "checkpoint.every": 3})
    _open_for_uid(fx.root)
    result = engine.run(smoke_image, ["finetune", "--config", "/fx/config.yaml", "--allow-fallback"],
                        network="none", volumes={str(fx.root): {"bind": "/fx", "mode": "rw"}}, timeout=1200)
    assert result.exit_code == 0, result.output[-4000:]
    assert "allow-fallback" in result.output.lower() or "allow_fallback" in result.output.lower()
    out = fx.root / "out"
    report = json.loads((out / "run_report.json").read_text())
    assert report["allow_fallback"] is True
    assert report["verify"]["passed"] is False          # the override is recorded with the verdict it overrode
    assert report["packing_mode"] == "padded"           # packing + fallback would leak across documents
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith("."))
    assert checkpoints, "checkpoints must be written to the mounted volume"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_finetune_without_override_refuses_to_train(engine, smoke_image, tmp_path):
    fx = write_fixture(tmp_path / "fx", n_rows=32, mount_root="/fx", config_overrides={"train.max_steps": 2})
    _open_for_uid(fx.root)
    result = engine.run(smoke_image, ["finetune", "--config", "/fx/config.yaml"], network="none",
                        volumes={str(fx.root): {"bind": "/fx", "mode": "rw"}}, timeout=900)
    assert result.exit_code != 0
    assert "verify" in result.output.lower()
    assert not (fx.root / "out" / "checkpoints").exists() or not any((fx.root / "out" / "checkpoints").iterdir())
