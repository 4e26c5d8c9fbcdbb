"""The deb lock: hostile lock files are refused field by field, locked .debs are fetched once and
checked against their sha256 (a mismatch is exit 2 and leaves nothing in the cache), the local
repository lists exactly the locked files, and export/import re-hashes everything it carries."""
from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
from pathlib import Path

import pytest

from build.base import debs_lock
from build.cache import CacheLayout
from build.spec import REPO_ROOT
from contracts.events import EventLog

pytestmark = pytest.mark.unit
QUIET = EventLog(quiet=True)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def mirror(tmp_path):
    """A plain HTTP server over tmp_path/mirror, standing in for a Debian mirror."""
    root = tmp_path / "mirror"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/debian"
    server.shutdown()


def make_lock(mirror_root: Path, url: str, debs: dict[str, bytes], *, lie_about: str = "") -> debs_lock.DebLock:
    entries = []
    for name, data in debs.items():
        filename = f"pool/main/{name[0]}/{name}/{name}_1.0_amd64.deb"
        (mirror_root / "debian" / filename).parent.mkdir(parents=True, exist_ok=True)
        (mirror_root / "debian" / filename).write_bytes(data)
        pinned = hashlib.sha256(b"reviewed" if name == lie_about else data).hexdigest()
        entries.append(debs_lock.LockedDeb(package=name, version="1.0", architecture="amd64", filename=filename,
                                           size=len(data), sha256=pinned,
                                           fields={"Package": name, "Version": "1.0", "Architecture": "amd64",
                                                   "Priority": "required", "Depends": "libc6 (>= 2.34)"}))
    return debs_lock.DebLock(base="b", suite="bookworm", mirror=url, release_date="Sat, 11 Jul 2026 10:16:37 UTC",
                             inrelease_sha256="0" * 64, debs=tuple(entries))


def test_locked_debs_are_fetched_checked_and_then_served_from_the_cache(tmp_path, mirror):
    root, url = mirror
    lock = make_lock(root, url, {"base-files": b"deb one", "bash": b"deb two"})
    cache = CacheLayout(tmp_path / "cache")
    paths = debs_lock.ensure_debs(lock, cache, QUIET)
    assert [p.read_bytes() for p in paths] == [b"deb one", b"deb two"]
    for filename in root.rglob("*.deb"):
        filename.unlink()          # the mirror dropped them: the cache still serves the build
    assert debs_lock.ensure_debs(lock, cache, QUIET) == paths


def test_a_deb_that_does_not_match_the_lock_is_refused_and_not_cached(tmp_path, mirror):
    root, url = mirror
    lock = make_lock(root, url, {"bash": b"tampered bytes"}, lie_about="bash")
    cache = CacheLayout(tmp_path / "cache")
    with pytest.raises(debs_lock.DebLockErrors) as refused:
        debs_lock.ensure_debs(lock, cache, QUIET)
    text = refused.value.render()
    assert "bash 1.0" in text and "bases update" in text and "review" in text
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


def test_a_version_the_mirror_dropped_names_the_export_as_the_way_out(tmp_path, mirror):
    root, url = mirror
    lock = make_lock(root, url, {"bash": b"x"})
    for filename in root.rglob("*.deb"):
        filename.unlink()
    with pytest.raises(debs_lock.BuildFailure) as failed:
        debs_lock.ensure_debs(lock, CacheLayout(tmp_path / "cache"), QUIET)
    assert "HTTP 404" in str(failed.value) and "bases import" in failed.value.fix


def test_the_local_repository_lists_exactly_the_locked_debs(tmp_path, mirror):
    root, url = mirror
    lock = make_lock(root, url, {"base-files": b"one", "bash": b"two"})
    paths = debs_lock.ensure_debs(lock, CacheLayout(tmp_path / "cache"), QUIET)
    repo_url = debs_lock.write_repository(lock, paths, tmp_path / "repo")
    assert repo_url == f"file://{tmp_path / 'repo'}"
    packages = (tmp_path / "repo/dists/bookworm/main/binary-amd64/Packages").read_bytes()
    stanzas = debs_lock.parse_stanzas(packages.decode())
    assert [(s["Package"], s["Filename"], s["SHA256"]) for s in stanzas] == [
        (d.package, f"pool/{d.basename}", d.sha256) for d in lock.debs]
    release = (tmp_path / "repo/dists/bookworm/Release").read_text()
    assert f" {hashlib.sha256(packages).hexdigest()} {len(packages)} main/binary-amd64/Packages" in release
    assert "Date: Sat, 11 Jul 2026 10:16:37 UTC" in release      # the base's time is the lock's
    assert sorted(p.name for p in (tmp_path / "repo/pool").iterdir()) == sorted(d.basename for d in lock.debs)


def write_json_lock(folder: Path, lock: debs_lock.DebLock, mutate=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads(lock.to_json())
    if mutate:
        mutate(data)
    (folder / debs_lock.LOCK_NAME).write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("mutate, named", [
    (lambda d: d["debs"][0].update(filename="pool/../../etc/passwd.deb"), "debs[0].filename"),
    (lambda d: d["debs"][0].update(sha256="abc"), "debs[0].sha256"),
    (lambda d: d["debs"][0]["fields"].update(Depends="libc6\nPackage: evil"), "debs[0].fields"),
    (lambda d: d["debs"][0]["fields"].update(Filename="pool/x.deb"), "debs[0].fields"),
    (lambda d: d["debs"][0].update(package="Bad Name"), "debs[0].package"),
    (lambda d: d.update(debs=[]), "debs"),
    (lambda d: d.update(format=99), "format"),
])
def test_a_hostile_lock_is_refused_naming_the_field(tmp_path, mirror, mutate, named):
    root, url = mirror
    folder = write_json_lock(tmp_path / "base", make_lock(root, url, {"bash": b"x"}), mutate)
    with pytest.raises(debs_lock.DebLockErrors) as refused:
        debs_lock.load_lock(folder)
    assert named in refused.value.render() and "bases update" in refused.value.render()


def test_a_round_trip_through_the_json_lock_is_exact(tmp_path, mirror):
    root, url = mirror
    lock = make_lock(root, url, {"bash": b"x", "apt": b"y"})
    loaded = debs_lock.load_lock(write_json_lock(tmp_path / "base", lock))
    assert loaded.to_json() == debs_lock.DebLock(**{**lock.__dict__, "debs": tuple(
        sorted(lock.debs, key=lambda d: d.package))}).to_json()


def test_export_then_import_rehashes_and_takes_only_locked_debs(tmp_path, mirror):
    root, url = mirror
    lock = make_lock(root, url, {"base-files": b"one", "bash": b"two"})
    exported = tmp_path / "export"
    assert debs_lock.export_debs([lock], CacheLayout(tmp_path / "cache-a"), exported, QUIET) == 2
    (exported / "evil_1.0_amd64.deb").write_bytes(b"no lock names me")
    fresh = CacheLayout(tmp_path / "cache-b")
    assert debs_lock.import_debs([lock], fresh, exported) == 2
    assert not list((tmp_path / "cache-b").rglob("evil*"))
    (exported / lock.debs[1].basename).write_bytes(b"swapped")
    with pytest.raises(debs_lock.DebLockErrors) as refused:
        debs_lock.import_debs([lock], CacheLayout(tmp_path / "cache-c"), exported)
    assert "bash 1.0" in refused.value.render()



def test_an_import_reads_no_link_and_no_byte_of_a_file_of_the_wrong_size(tmp_path, mirror):
    """A symlinked .deb (it could point anywhere) is refused, and so is a file whose size is not
    the lock's, before anything is copied: a 1 GiB sparse stand-in costs nothing to refuse."""
    root, url = mirror
    lock = make_lock(root, url, {"base-files": b"one", "bash": b"two"})
    exported = tmp_path / "export"
    debs_lock.export_debs([lock], CacheLayout(tmp_path / "cache-a"), exported, QUIET)
    target = exported / lock.debs[1].basename
    target.unlink()
    sparse = tmp_path / "huge.deb"
    with sparse.open("wb") as fh:
        fh.truncate(1 << 30)
    target.symlink_to(sparse)
    with pytest.raises(debs_lock.DebLockErrors) as refused:
        debs_lock.import_debs([lock], CacheLayout(tmp_path / "cache-b"), exported)
    assert "symbolic link" in refused.value.render()
    target.unlink()
    with target.open("wb") as fh:
        fh.truncate(1 << 30)
    with pytest.raises(debs_lock.DebLockErrors) as refused:
        debs_lock.import_debs([lock], CacheLayout(tmp_path / "cache-c"), exported)
    assert "holds 1073741824 bytes" in refused.value.render()
    assert not [p for p in (tmp_path / "cache-c").rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]

def test_an_export_never_writes_through_a_link_planted_in_its_folder(tmp_path, mirror):
    root, url = mirror
    lock = make_lock(root, url, {"base-files": b"one", "bash": b"two"})
    exported = tmp_path / "export"
    exported.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    planted = exported / lock.debs[1].basename
    planted.symlink_to(victim)
    with pytest.raises(debs_lock.DebLockErrors) as refused:
        debs_lock.export_debs([lock], CacheLayout(tmp_path / "cache"), exported, QUIET)
    text = refused.value.render()
    assert f"{planted} is a symbolic link to {victim}: an export never writes through one" in text
    assert f"remove {planted}, or export into a new folder" in text
    assert victim.read_bytes() == b"keep me" and planted.is_symlink()
    assert sorted(p.name for p in exported.iterdir()) == sorted([lock.debs[0].basename, lock.debs[1].basename])
    assert (exported / lock.debs[0].basename).read_bytes() == b"one"      # written whole, before the refusal


def test_an_export_copies_the_locked_bytes_and_evicts_a_damaged_cache_entry(tmp_path, mirror):
    """ensure_debs trusts a cached .deb of the lock's size; the export hashes what it copies, so
    one edited in place at the same size is refused, removed from the cache and not exported."""
    root, url = mirror
    lock = make_lock(root, url, {"base-files": b"one", "bash": b"two"})
    cache = CacheLayout(tmp_path / "cache")
    paths = debs_lock.ensure_debs(lock, cache, QUIET)
    paths[1].write_bytes(b"TWO")
    exported = tmp_path / "export"
    with pytest.raises(debs_lock.DebLockErrors) as refused:
        debs_lock.export_debs([lock], cache, exported, QUIET)
    text = refused.value.render()
    assert (f"the cached {paths[1]} has sha256 {hashlib.sha256(b'TWO').hexdigest()}, but {lock.debs[1].sha256} is "
            "recorded for it; it was removed from the cache") in text
    assert not paths[1].exists() and not (exported / lock.debs[1].basename).exists()
    assert not [p for p in exported.iterdir() if p.name.startswith(".tmp-")]
    assert debs_lock.export_debs([lock], cache, exported, QUIET) == 2      # fetched again from the mirror
    assert (exported / lock.debs[1].basename).read_bytes() == b"two"


def test_the_committed_base_locks_load(tmp_path):
    """Every lock in images/_bases is valid, and pins the packages its base.yaml asks for."""
    found = 0
    for folder in sorted((REPO_ROOT / "images" / "_bases").iterdir()):
        lock = debs_lock.load_lock(folder)
        if lock is None:
            continue
        found += 1
        names = {d.package for d in lock.debs}
        import yaml

        asked = set(yaml.safe_load((folder / "base.yaml").read_text())["packages"])
        assert asked <= names, f"{folder.name}: {asked - names} not pinned"
    assert found >= 1


def test_importing_a_tampered_export_through_the_cli_is_exit_2(tmp_path, run_cli):
    lock = debs_lock.load_lock(REPO_ROOT / "images" / "_bases" / "debian-bookworm")
    exported = tmp_path / "export"
    exported.mkdir()
    (exported / lock.debs[0].basename).write_bytes(b"not the reviewed bytes")
    code, out, err = run_cli(["bases", "import", str(exported), "--cache", str(tmp_path / "cache")])
    assert code == 2 and lock.debs[0].package in err and "bases update" in err and "Traceback" not in err
