"""Fixtures for entrypoint tests: one tiny model + tokenizer + chat data per session."""
from __future__ import annotations

import pytest

from entrypoint.testing import Fixture, write_fixture


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Fixture:
    return write_fixture(tmp_path_factory.mktemp("ft-fixture"))


@pytest.fixture(scope="session")
def tokenizer(fixture_dir):
    from entrypoint.model import load_tokenizer

    return load_tokenizer(str(fixture_dir.model_dir))
