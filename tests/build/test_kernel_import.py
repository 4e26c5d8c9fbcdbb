"""`kernels import` proves what it imports. Each attack below was imported by earlier releases."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from build.cache import CacheLayout
from build.kernels.store import KernelStore
from build.resolve import digest
from tests.build import kernel_wheels
from tests.conftest import run_build_cli
from tests.fixtures.keys import write_p256_pair, write_rsa_key

pytestmark = pytest.mark.unit


def _entry(store_root: Path, kernel: str = "causal-conv1d", version: str = "1.7.0", archs=("sm_90",),
           payload: bytes = b"kernel") -> str:
    """A cache entry as a compile publishes it (a wheel with SASS for its archs, meta.json, build.log)."""
    inputs = kernel_wheels.key_inputs(kernel, version, archs)
    key = digest(inputs)
    kernel_wheels.write_entry(store_root / "kernels" / key, inputs, payload=payload)
    return key


@pytest.fixture
def exported(tmp_path):
    """A signed export of two entries, and the key pair."""
    src = tmp_path / "src-cache"
    keys = [_entry(src), _entry(src, "flash-attn", "2.8.3.post2")]
    private, public = write_p256_pair(tmp_path)
    export = tmp_path / "export"
    proc = run_build_cli("kernels", "export", str(export), "--cache", str(src), "--sign", str(private))
    assert proc.returncode == 0, proc.stderr
    assert "manifest signed by sha256:" in proc.stdout
    return {"dir": export, "keys": keys, "public": public, "private": private, "tmp": tmp_path}


def _import(exported, *extra, cache=None):
    cache = cache or exported["tmp"] / "dest-cache"
    proc = run_build_cli("kernels", "import", str(exported["dir"]), "--cache", str(cache), *extra)
    return proc, KernelStore(CacheLayout(cache))


def test_a_signed_export_imports_with_its_key(exported):
    proc, store = _import(exported, "--key", str(exported["public"]))
    assert proc.returncode == 0, proc.stderr
    for key in exported["keys"]:
        entry = store.get(key)
        assert entry is not None and entry.meta["imported_signature"] == "verified"
    assert "Traceback" not in proc.stderr


def test_unsigned_or_otherwise_signed_exports_are_refused(exported):
    _other_private, other_public = write_p256_pair(exported["tmp"], "other")
    proc, store = _import(exported, "--key", str(other_public))
    assert proc.returncode == 3 and "does not verify" in proc.stderr and store.entries() == []
    proc, store = _import(exported)
    assert proc.returncode == 3 and "without verifying a signature" in proc.stderr and "--trust-unsigned" in proc.stderr
    (exported["dir"] / "export-manifest.json.sig").unlink()
    proc, store = _import(exported, "--key", str(exported["public"]))
    assert proc.returncode == 3 and "is not signed" in proc.stderr and store.entries() == []
    proc, store = _import(exported, "--trust-unsigned")
    assert proc.returncode == 0 and "WITHOUT a verified signature" in proc.stderr
    assert {e.meta["imported_signature"] for e in store.entries()} == {"none (--trust-unsigned)"}


def _refused(exported, key: str, reason: str, *, trust_unsigned: bool = True):
    proc, store = _import(exported, *(["--trust-unsigned"] if trust_unsigned else ["--key", str(exported["public"])]))
    assert proc.returncode == 3, proc.stderr
    assert f"refused {key}" in proc.stderr and reason in proc.stderr, proc.stderr
    assert store.get(key) is None
    assert "Traceback" not in proc.stderr
    return store


def test_an_extra_file_in_an_entry_is_refused(exported):
    key = exported["keys"][0]
    (exported["dir"] / key / "evil.pth").write_text("import os; os.system('id')\n")
    store = _refused(exported, key, "evil.pth")
    assert not list(store.root.rglob("evil.pth"))


def test_a_symlink_in_an_entry_is_never_followed(exported):
    key = exported["keys"][0]
    os.symlink("/etc/shadow", exported["dir"] / key / "build.log.tmp")
    store = _refused(exported, key, "not a regular file")
    assert not [p for p in store.root.rglob("*") if p.name.startswith("build.log.tmp")]
    os.unlink(exported["dir"] / key / "build.log.tmp")
    log = exported["dir"] / key / "build.log"
    log.unlink()
    os.symlink("/etc/shadow", log)
    _refused(exported, key, "build.log is not a regular file")


def test_an_entry_renamed_to_another_key_is_refused(exported):
    conv, flash = exported["keys"]
    shutil.rmtree(exported["dir"] / conv)
    os.rename(exported["dir"] / flash, exported["dir"] / conv)
    meta_path = exported["dir"] / conv / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["key"] = conv
    meta_path.write_text(json.dumps(meta))
    _refused(exported, conv, "recomputed from meta.json's inputs")


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m["inputs"].update(archs=["sm_100"]), "recomputed"),
    (lambda m: m.update(version="9.9.9"), "version"),
    (lambda m: m["archs"].update(sass=["sm_100"]), "archs"),
    (lambda m: m["inputs"].update(version="1.7.1"), "recomputed"),
])
def test_edited_meta_is_refused(exported, edit, reason):
    key = exported["keys"][0]
    meta_path = exported["dir"] / key / "meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    _refused(exported, key, reason)


def test_a_replaced_wheel_with_its_sha256_updated_is_stopped_only_by_the_signature(exported):
    key = exported["keys"][0]
    entry = exported["dir"] / key
    meta = json.loads((entry / "meta.json").read_text())
    with zipfile.ZipFile(entry / meta["wheel"], "w") as zf:
        zf.writestr("causal_conv1d/__init__.py", "import os; os.system('id')\n")
    meta["sha256"] = hashlib.sha256((entry / meta["wheel"]).read_bytes()).hexdigest()
    (entry / "meta.json").write_text(json.dumps(meta, sort_keys=True))
    _refused(exported, key, "not the one the manifest lists", trust_unsigned=False)
    # rewriting the manifest too breaks its signature
    manifest_path = exported["dir"] / "export-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["entries"][key]["wheel_sha256"] = meta["sha256"]
    manifest["entries"][key]["meta_sha256"] = hashlib.sha256((entry / "meta.json").read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    proc, store = _import(exported, "--key", str(exported["public"]), cache=exported["tmp"] / "fresh-cache")
    assert proc.returncode == 3 and "does not verify" in proc.stderr and store.entries() == []


def test_a_key_that_is_not_p256_is_exit_2(exported):
    export = exported["tmp"] / "export2"
    proc = run_build_cli("kernels", "export", str(export), "--cache", str(exported["tmp"] / "src-cache"),
                         "--sign", str(write_rsa_key(exported["tmp"])))
    assert proc.returncode == 2 and "not a P-256" in proc.stderr and "prime256v1" in proc.stderr
    assert not export.exists()
    garbage = exported["tmp"] / "garbage.key"
    garbage.write_text("not a key")
    proc = run_build_cli("kernels", "export", str(export), "--cache", str(exported["tmp"] / "src-cache"),
                         "--sign", str(garbage))
    assert proc.returncode == 2 and "not a PEM private key" in proc.stderr and "Traceback" not in proc.stderr


def test_the_signature_is_cosign_compatible(exported):
    """cosign verify-blob checks an ECDSA-P256/SHA-256 DER signature, base64, over the file's bytes."""
    import base64

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    public = serialization.load_pem_public_key(exported["public"].read_bytes())
    signature = base64.b64decode((exported["dir"] / "export-manifest.json.sig").read_text().strip())
    public.verify(signature, (exported["dir"] / "export-manifest.json").read_bytes(), ec.ECDSA(hashes.SHA256()))


def test_a_build_log_without_its_sha256_is_refused_and_never_exported(exported):
    """meta.json covers every file of an entry: a build.log it gives no digest for is not imported
    (nor, from a cache, exported), so an export of this version always carries the digest."""
    key = exported["keys"][0]
    meta_path = exported["dir"] / key / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["build_log_sha256"]
    meta_path.write_text(json.dumps(meta, sort_keys=True))
    _refused(exported, key, f"refused {key}: meta.json gives no build_log_sha256 for its build.log, so the log "
             "cannot be checked: export it again with this version (its exports always carry it)")
    source = exported["tmp"] / "src-cache" / "kernels" / key
    (source / "meta.json").write_text(json.dumps(meta, sort_keys=True))
    proc = run_build_cli("kernels", "export", str(exported["tmp"] / "again"), "--cache",
                         str(exported["tmp"] / "src-cache"))
    assert proc.returncode == 0 and f"skipped {key[:16]}: meta.json gives no build_log_sha256" in proc.stderr
    assert not (exported["tmp"] / "again" / key).exists() and (exported["tmp"] / "again" / exported["keys"][1]).is_dir()


@pytest.mark.parametrize("change", ["grows", "grows while copied", "other bytes, same size", "a link"])
@pytest.mark.parametrize("which", ["wheel", "build.log"])
def test_a_file_that_changes_after_it_was_proven_is_not_imported(exported, monkeypatch, change, which):
    """The copy reads no further than the size that was hashed and hashes again as it copies: a
    file that grows, or is swapped, between the proof and the copy (or during it) is refused, and
    nothing of the entry is left in the cache."""
    from build import cache as cache_module
    from build.kernels import portable
    from contracts.events import EventLog

    key = exported["keys"][0]
    entry = exported["dir"] / key
    name = json.loads((entry / "meta.json").read_text())["wheel"] if which == "wheel" else "build.log"
    target = entry / name
    size = target.stat().st_size
    outside = exported["tmp"] / "outside"
    outside.write_bytes(target.read_bytes())
    real = portable.prove_entry

    def prove_then_change(directory, entry_key, *args, **kwargs):
        proven = real(directory, entry_key, *args, **kwargs)
        if entry_key == key:
            if change == "grows":
                with target.open("ab") as fh:
                    fh.write(b"more")
            elif change == "a link":
                target.unlink()
                target.symlink_to(outside)
            else:
                target.write_bytes(bytes(size))
        return proven

    real_open, opened = cache_module.open_regular, []

    def open_then_grow(path, *, size=None):
        fd = real_open(path, size=size)
        opened.append(Path(path))
        if Path(path) == target and opened.count(target) == 2:    # the first open hashed it, this one copies
            with target.open("ab") as fh:
                fh.write(b"more")
        return fd

    if change == "grows while copied":
        monkeypatch.setattr(cache_module, "open_regular", open_then_grow)
    else:
        monkeypatch.setattr(portable, "prove_entry", prove_then_change)
    store = KernelStore(CacheLayout(exported["tmp"] / "dest-cache"))
    imported, rejected = portable.import_from(store, exported["dir"], trust_unsigned=True, log=EventLog(quiet=True))
    why = {"grows": f"{target} holds {size + 4} bytes, but {size} are recorded for it",
           "grows while copied": f"{target} grew while it was copied (past the {size} bytes it held)",
           "a link": f"{target} is a symbolic link to {outside}",
           "other bytes, same size": f"{target} has sha256 {hashlib.sha256(bytes(size)).hexdigest()}, but "
                                     f"{hashlib.sha256(outside.read_bytes()).hexdigest()} is recorded for it"}[change]
    assert rejected == [(key, why)] and imported == [exported["keys"][1]]
    assert store.get(key) is None and not (store.root / key).exists()
    assert not [p for p in store.root.iterdir() if p.name.startswith(".tmp-")]
