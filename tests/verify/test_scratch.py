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


def test_a_uid_with_no_home_and_no_passwd_entry_gets_a_private_home(tmp_path, monkeypatch):
    # `env -u HOME` (or an OCI config.json with no HOME) for a uid the image's passwd does not
    # know: Path.home() raises RuntimeError there, which verify showed as a traceback
    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(scratch.pwd, "getpwuid", unknown)
    monkeypatch.setattr(scratch, "CANDIDATES", (str(tmp_path),))
    monkeypatch.delenv("HOME", raising=False)
    env = {}
    assert scratch.ensure_scratch(env) == tmp_path
    private = tmp_path / f"ftimage-{os.getuid()}"
    assert env["HOME"] == str(private / "home") and env["TRITON_CACHE_DIR"] == str(private / "triton")


def test_home_of_falls_back_to_the_passwd_entry():
    import pwd

    assert scratch.home_of({"HOME": "/somewhere"}) == "/somewhere"
    assert scratch.home_of({}) == pwd.getpwuid(os.getuid()).pw_dir


@pytest.fixture
def no_tempfile_dir(tmp_path, monkeypatch):
    """What a read-only root with no tmpfs looks like to tempfile: none of its folders is writable."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(tmp_path / "read-only-tmp")])
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    return tmp_path


def test_ensure_tempdir_moves_tmpdir_to_private_scratch_where_tempfile_finds_none(no_tempfile_dir, monkeypatch):
    import tempfile

    shm = no_tempfile_dir / "shm"         # docker --read-only keeps /dev/shm writable; tempfile never tries it
    shm.mkdir()
    monkeypatch.setattr(scratch, "CANDIDATES", (str(shm),))
    env = {}
    chosen = scratch.ensure_tempdir(env)
    assert chosen == env["TMPDIR"] == str(shm / f"ftimage-{os.getuid()}" / "tmp")
    assert os.path.isdir(chosen) and tempfile.tempdir is None   # the next gettempdir() reads the new TMPDIR


def test_ensure_tempdir_with_nothing_writable_names_the_folders_and_the_fix(no_tempfile_dir, monkeypatch):
    monkeypatch.setattr(scratch, "CANDIDATES", (str(no_tempfile_dir / "a"), str(no_tempfile_dir / "b")))
    with pytest.raises(scratch.NoScratch) as info:
        scratch.ensure_tempdir({})
    assert str(no_tempfile_dir / "a") in str(info.value) and "--tmpfs /tmp" in info.value.fix
