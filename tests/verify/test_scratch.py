"""verify finds a writable temp dir (or says clearly that there is none)."""
from __future__ import annotations

import os
import stat

import pytest

from verify import scratch

pytestmark = pytest.mark.unit


def test_an_unusable_tmpdir_falls_through_to_the_next_candidate(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch, "CANDIDATES", (str(tmp_path / "missing"), str(tmp_path)))
    env = {"TMPDIR": str(tmp_path / "also-missing"), "TRITON_CACHE_DIR": "/proc/1/nope/triton"}
    assert scratch.ensure_scratch(env) == tmp_path
    assert env["TMPDIR"] == str(tmp_path)
    # the JIT cache lands in this user's private folder (0700), never a path another user could plant
    private = tmp_path / f"ftimage-{os.getuid()}"
    assert env["TRITON_CACHE_DIR"] == str(private / "triton")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.getuid()


def test_no_writable_dir_is_a_named_failure_with_a_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch, "CANDIDATES", (str(tmp_path / "a"), str(tmp_path / "b")))
    with pytest.raises(scratch.NoScratch) as info:
        scratch.ensure_scratch({"TMPDIR": str(tmp_path / "c")})
    assert str(tmp_path / "a") in str(info.value) and "--tmpfs /tmp" in info.value.fix
