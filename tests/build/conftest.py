"""Fixtures for build/ tests: an editable copy of the shipped specs in a temp folder."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from build.cli.main import main
from build.spec import REPO_ROOT


class Workspace:
    """Copies of kernels_manifest.yaml and the shipped images, to mutate per test."""

    def __init__(self, root: Path):
        self.root = root
        self.manifest = root / "kernels_manifest.yaml"
        self.reset()

    def reset(self) -> None:
        """Back to the shipped specs (Hypothesis reuses one workspace across examples)."""
        shutil.copyfile(REPO_ROOT / "kernels_manifest.yaml", self.manifest)
        for name in ("smoke", "qwen27b", "kernel-smoke"):
            shutil.rmtree(self.root / "images" / name, ignore_errors=True)
            shutil.copytree(REPO_ROOT / "images" / name, self.root / "images" / name)

    def image(self, name: str) -> Path:
        return self.root / "images" / name

    def load(self, name: str) -> dict:
        return yaml.safe_load((self.image(name) / "image.yaml").read_text())

    def save(self, name: str, data: dict) -> None:
        (self.image(name) / "image.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    def load_manifest(self) -> dict:
        return yaml.safe_load(self.manifest.read_text())

    def save_manifest(self, data: dict) -> None:
        self.manifest.write_text(yaml.safe_dump(data, sort_keys=False))

    def plan(self, name: str, *extra: str) -> list[str]:
        return [str(self.image(name)), "--plan", "--manifest", str(self.manifest), "--cache",
                str(self.root / "cache"), *extra]


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path)


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    def _run(argv: list[str]):
        code = main(argv)
        out = capsys.readouterr()
        return code, out.out, out.err
    return _run


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two P-256 signing pairs, "signer" and "other": (private key, public key, private path, public path)."""
    from build import signing
    from tests.fixtures.keys import write_p256_pair

    folder = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("signer", "other"):
        private, public = write_p256_pair(folder, name)
        out[name] = (signing.load_private_key(private), signing.load_public_key(public), private, public)
    return out
