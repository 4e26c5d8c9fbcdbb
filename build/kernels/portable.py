"""Moving compiled kernels between machines: `kernels export DIR [--sign KEY]` and
`kernels import DIR [--key PUB | --trust-unsigned]`.

An export is a folder of cache entries plus `export-manifest.json`, which names every entry's
key, wheel and the sha256 of its wheel and meta.json; `--sign` adds `export-manifest.json.sig`,
a cosign-format signature of the manifest (`cosign verify-blob --key PUB --signature
export-manifest.json.sig export-manifest.json` checks it too).

Import proves what it imports, entry by entry, and refuses the rest (exit 3):
  * an entry is exactly meta.json, its wheel and (optionally) build.log, all regular files: no
    symlink is followed, no extra file (a `.pth`, say) is copied;
  * the folder name is the key, and the key is recomputed from meta.json's `inputs`: an entry
    renamed to another key, or with edited inputs, does not match;
  * the wheel and build log match their sha256 (an entry with a build log meta.json gives no
    sha256 for is refused: every export of this version carries it);
  * the acceptance a registry hit gets (acceptance.py), against the key's own inputs: meta.json's
    kernel, version, archs, wheel name and tags, and the torch, CUDA and compiler it recorded;
    then, on the copy about to enter the cache, the wheel's own SASS and PTX per arch, and the
    tags, name and version its dist-info holds;
  * what is copied into the cache is exactly the bytes that were hashed: no more than the size
    each file had then, and the same sha256 again, hashed as they are copied;
  * the manifest lists the entry with the same wheel and meta.json digests, and the manifest's
    signature verifies with the key given.
What only the signature proves: that the wheel is the one the signer's machine compiled from
those inputs. Without a signature (`--trust-unsigned`, logged), a wheel replaced together with
its sha256, holding the right archs and tags, passes every other check. Either way, every build
that uses an imported wheel runs the in-image checks (import/ABI, entry points) before it
succeeds.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from build.cache import copy_nofollow, digest_nofollow
from build.errors import BuildFailure
from build.kernels.acceptance import Expected, meta_problems, refusal, wheel_problems
from build.kernels.store import KEY, META, WHEEL, KernelStore
from contracts import atomic
from contracts.errors import FixableError

MANIFEST = "export-manifest.json"
SIGNATURE = MANIFEST + ".sig"
BUILD_LOG = "build.log"
META_LIMIT = 1 << 20
LOG_LIMIT = 1 << 30    # a compile's log is megabytes; an entry is refused before a larger one is read
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
EXIT_REFUSED = 3


class ImportRefused(FixableError):
    exit_code = EXIT_REFUSED   # build/cli/main.py maps it to its EXIT_REFUSED, the same 3

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


@dataclass(frozen=True)
class ProvenEntry:
    key: str
    directory: Path
    meta: dict
    files: tuple[str, ...]
    proven: dict[str, tuple[str, int]]   # file -> (sha256, size) as hashed: what a copy must find again
    expected: Expected                   # what it was checked against


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _read_small(path: Path, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is over {limit} bytes")
    return data


def prove_entry(directory: Path, key: str, expected: Expected | None = None, *,
                torch_versions: dict[str, str] | None = None, read_wheel: bool = True) -> ProvenEntry:
    """Everything an entry proves about itself and against its key's own inputs; ValueError says
    what it cannot. `expected`: the key's inputs from the plan (a registry hit in a build);
    without it, meta.json's inputs once they hash to `key`, with the torch version
    `torch_versions` maps their torch wheel's sha256 to. `read_wheel=False` leaves out the checks
    that read the wheel's content (an import runs them on the copy it is about to publish)."""
    st = _lstat(directory)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise ValueError("not a real folder (a symlink or a file)")
    if not KEY.fullmatch(key):
        raise ValueError("its name is not a kernel key")
    names = sorted(os.listdir(directory))
    sizes = {}
    for name in names:
        entry_st = _lstat(directory / name)
        if entry_st is None or not stat.S_ISREG(entry_st.st_mode):
            raise ValueError(f"{name} is not a regular file (symlinks and folders are never imported)")
        sizes[name] = entry_st.st_size
    if META not in names:
        raise ValueError("it has no meta.json")
    meta = json.loads(_read_small(directory / META, META_LIMIT))
    if not isinstance(meta, dict) or not isinstance(meta.get("inputs"), dict):
        raise ValueError("meta.json has no inputs")
    wheel = meta.get("wheel")
    if not isinstance(wheel, str) or not WHEEL.fullmatch(wheel):
        raise ValueError(f"meta.json names an invalid wheel {str(wheel)[:40]!r}")
    extra = sorted(set(names) - {META, wheel, BUILD_LOG})
    if extra:
        raise ValueError(f"it holds files an entry never has: {', '.join(extra[:5])}")
    if wheel not in names:
        raise ValueError(f"{wheel} is missing")
    if meta.get("key") != key:
        raise ValueError("meta.json's key is not the folder's name")
    inputs = meta["inputs"]
    if expected is None:
        torch = (torch_versions or {}).get(str(inputs.get("torch_wheel_sha256")))
        expected = Expected(key, inputs, torch)
    problems = meta_problems(meta, expected)
    if problems:
        raise ValueError(refusal(problems))
    proven = {wheel: digest_nofollow(directory / wheel)}
    if proven[wheel][0] != meta.get("sha256"):
        raise ValueError(f"{wheel} does not match meta.json's sha256")
    if read_wheel:
        problems = wheel_problems(directory / wheel, meta, expected)
        if problems:
            raise ValueError(refusal(problems))
    if BUILD_LOG in names:
        if not isinstance(meta.get("build_log_sha256"), str) or not SHA256_HEX.fullmatch(meta["build_log_sha256"]):
            raise ValueError("meta.json gives no build_log_sha256 for its build.log, so the log cannot be checked: "
                             "export it again with this version (its exports always carry it)")
        if sizes[BUILD_LOG] > LOG_LIMIT:
            raise ValueError(f"build.log is over {LOG_LIMIT >> 20} MiB")
        proven[BUILD_LOG] = digest_nofollow(directory / BUILD_LOG)
        if proven[BUILD_LOG][0] != meta["build_log_sha256"]:
            raise ValueError("build.log does not match meta.json's build_log_sha256")
    return ProvenEntry(key=key, directory=directory, meta=meta, files=tuple(n for n in names if n != META),
                       proven=proven, expected=expected)


def _copy_proven(entry: ProvenEntry, name: str, dest: Path) -> None:
    """Copy one file of a proven entry: the bytes that were hashed, or an UnsafeFile (a ValueError)."""
    sha256, size = entry.proven[name]
    copy_nofollow(entry.directory / name, dest, size=size, sha256=sha256)


def manifest_for(entries: list[ProvenEntry]) -> bytes:
    body = {"format": 1, "entries": {
        e.key: {"kernel": e.meta["kernel"], "version": e.meta["version"], "wheel": e.meta["wheel"],
                "wheel_sha256": e.meta["sha256"], "meta_sha256": digest_nofollow(e.directory / META)[0]}
        for e in sorted(entries, key=lambda e: e.key)}}
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def export(store: KernelStore, destination: Path, *, sign_key=None) -> tuple[list[str], list[tuple[str, str]]]:
    """Copy every cache entry that proves itself to `destination`, with the manifest (and its
    signature). Returns (exported keys, skipped entries with why)."""
    from build import signing  # cryptography: `kernels build-here` loads this module on a GPU host without it

    destination.mkdir(parents=True, exist_ok=True)
    written: list[ProvenEntry] = []
    skipped: list[tuple[str, str]] = []
    for entry in store.entries():
        try:
            proven = prove_entry(entry.directory, entry.key)
        except (ValueError, OSError) as exc:
            skipped.append((entry.key, str(exc)))
            continue
        target = destination / entry.key
        staging = atomic.staging_dir(destination, entry.key[:16])
        try:
            copy_nofollow(entry.directory / META, staging / META)
            for name in proven.files:
                _copy_proven(proven, name, staging / name)
        except ValueError as exc:     # changed since it was proven: not exported, and nothing half-written
            shutil.rmtree(staging, ignore_errors=True)
            skipped.append((entry.key, str(exc)))
            continue
        atomic.publish_dir(staging, target, replace=target.exists())
        # the copy re-hashed as it was made: its wheel is the one whose content was just read
        written.append(prove_entry(target, entry.key, proven.expected, read_wheel=False))
    manifest = manifest_for(written)
    atomic.write_bytes(destination / MANIFEST, manifest)
    if sign_key is not None:
        atomic.write_text(destination / SIGNATURE, signing.sign(manifest, sign_key) + "\n")
    else:
        (destination / SIGNATURE).unlink(missing_ok=True)
    return [e.key for e in written], skipped


def read_manifest(source: Path, *, public_key, trust_unsigned: bool, log) -> dict | None:
    """The export's manifest entries once its signature verified (or None with --trust-unsigned
    and no manifest). ImportRefused otherwise."""
    from build import signing  # as in export(): only when a manifest's signature is read

    manifest_path, sig_path = source / MANIFEST, source / SIGNATURE
    try:
        manifest = _read_small(manifest_path, 64 << 20) if _lstat(manifest_path) else None
        signature = _read_small(sig_path, 4096).decode("ascii", "replace") if _lstat(sig_path) else None
    except (OSError, ValueError) as exc:
        raise ImportRefused(f"{source}: the manifest or its signature is unreadable ({exc})",
                            "export again with `kernels export DIR --sign KEY`") from None
    if public_key is not None:
        if manifest is None or signature is None:
            raise ImportRefused(f"{source} is not signed (no {MANIFEST if manifest is None else SIGNATURE})",
                                "ask for an export made with `kernels export DIR --sign KEY`, or pass "
                                "--trust-unsigned to import it on the folder's word alone")
        if not signing.verify(manifest, signature, public_key):
            raise ImportRefused(f"{source}: the signature of {MANIFEST} does not verify with key "
                                f"{signing.key_id(public_key)[:23]}... (signed by another key, or edited after "
                                "signing)",
                                "import with the public key of whoever exported it; never edit an export by hand")
        log.emit("kernels", f"export signature verified with key {signing.key_id(public_key)[:23]}...")
    elif not trust_unsigned:
        raise ImportRefused(f"refusing to import {source} without verifying a signature",
                            "pass --key PUB (the exporter's public key), or --trust-unsigned to import on the "
                            "folder's word alone (logged; a replaced wheel with its sha256 updated would pass)")
    else:
        log.emit("kernels", f"WARNING: importing {source} WITHOUT a verified signature (--trust-unsigned): each entry "
                 "is checked against itself only; the build's in-image checks still run before use")
    if manifest is None:
        return None
    try:
        body = json.loads(manifest)
        entries = body["entries"]
        if body.get("format") != 1 or not isinstance(entries, dict):
            raise ValueError("unknown manifest format")
    except (ValueError, KeyError, TypeError) as exc:
        raise ImportRefused(f"{source}/{MANIFEST} is unreadable: {exc}", "export again") from None
    return entries


def import_from(store: KernelStore, source: Path, *, public_key=None, trust_unsigned: bool = False,
                log, torch_versions: dict[str, str] | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """Import every entry `source` proves. Returns (imported, rejected with why). `torch_versions`:
    torch wheel sha256 -> torch version, for the toolchains the manifest pins (the recorded torch
    of an entry whose inputs name one of them must be that version)."""
    st = _lstat(source)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise BuildFailure(f"{source} is not a directory", "pass the directory written by `kernels export`")
    listed = read_manifest(source, public_key=public_key, trust_unsigned=trust_unsigned, log=log)
    imported: list[str] = []
    rejected: list[tuple[str, str]] = []
    names = sorted(n for n in os.listdir(source) if not n.startswith(".") and n not in (MANIFEST, SIGNATURE))
    for name in names:
        try:
            # the wheel's content is read from the copy below, not here: the folder is not ours,
            # and the bytes read must be the bytes published
            entry = prove_entry(source / name, name, torch_versions=torch_versions, read_wheel=False)
            if listed is not None:
                record = listed.get(name)
                if not isinstance(record, dict):
                    raise ValueError(f"the {'signed ' if public_key is not None else ''}manifest does not list it")
                if record.get("wheel_sha256") != entry.meta["sha256"] or \
                        record.get("meta_sha256") != digest_nofollow(entry.directory / META)[0]:
                    raise ValueError("its wheel or meta.json is not the one the manifest lists")
        except (ValueError, OSError) as exc:
            rejected.append((name, str(exc)))
            continue
        with store.lock(entry.key):
            if store.get(entry.key) is None:
                staging = store.staging(entry.key)
                try:
                    for file in entry.files:
                        _copy_proven(entry, file, staging / file)
                    problems = wheel_problems(staging / entry.meta["wheel"], entry.meta, entry.expected)
                    if problems:
                        raise ValueError(refusal(problems))
                    meta = {**entry.meta, "imported_from": str(source),
                            "imported_signature": "verified" if public_key is not None else "none (--trust-unsigned)"}
                    store.publish(entry.key, staging, meta)
                except ValueError as exc:    # changed since it was proven, or its wheel is not its key's
                    rejected.append((name, str(exc)))
                    continue
                finally:
                    shutil.rmtree(staging, ignore_errors=True)   # gone already once published
        imported.append(entry.key)
    for key in sorted(set(listed or ()) - set(names)):
        rejected.append((key, "listed in the manifest but missing from the folder"))
    return imported, rejected
