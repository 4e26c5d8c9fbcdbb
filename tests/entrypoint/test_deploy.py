"""The shipped deploy examples parse and agree with the entrypoint's config and launcher."""
from __future__ import annotations

from pathlib import Path

import pytest

from contracts.finetune_config import build_config, read_yaml

pytestmark = pytest.mark.unit
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_config_is_valid():
    cfg = build_config([read_yaml(DEPLOY / "finetune.example.yaml")])
    assert cfg.packing.mode == "packed" and cfg.parallel.param_dtype == "bfloat16"
