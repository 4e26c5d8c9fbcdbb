"""Fixtures for entrypoint tests: one tiny model + tokenizer + chat data per session."""
from __future__ import annotations

import pytest

from tests.fixtures.chat import Fixture, write_fixture

# Rows every training run must survive and report: one unparseable line, one without
# `messages`, one whose reply runs past data.max_length (512) and gets truncated.
BAD_ROWS = [
    "{this is not json",
    {"prompt": "no messages here"},
    {"messages": [{"role": "user", "content": "go on"},
                  {"role": "assistant", "content": " ".join(["tree river"] * 400)}]},
]


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Fixture:
    return write_fixture(tmp_path_factory.mktemp("ft-fixture"), extra_rows=BAD_ROWS)


@pytest.fixture(scope="session")
def tokenizer(fixture_dir):
    from entrypoint.model import load_tokenizer

    return load_tokenizer(str(fixture_dir.model_dir))


@pytest.fixture
def gate_environ(monkeypatch):
    """The gate updates os.environ (caches, HOME, the override) before it execs: tests that call it
    in-process give it a copy, so the test process keeps its own environment."""
    import os

    copy = dict(os.environ)
    monkeypatch.setattr(os, "environ", copy)
    return copy
