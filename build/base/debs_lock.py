"""A bootstrapped base pinned by content: the deb lock.

`images/_bases/<base>/debs.lock.json` names every `.deb` the base is bootstrapped from, with its
version, size and sha256, taken from the mirror's Packages index after the index's InRelease
was verified with Debian's archive keyring. It is committed, and it changes only through
`python -m build bases update BASE_DIR`, a reviewed change.

With a lock, a bootstrap never asks the mirror what to install: each `.deb` is fetched into a
content-addressed cache (`<cache>/debs/`, checked against the lock's sha256), a local
repository is written from exactly those files, and debootstrap installs from it. The mirror
drops superseded versions, so "the same inputs" means: from the cache or an export
(`bases export/import`), on any day; from the network, while the mirror still serves them.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from build.cache import CacheLayout, UnsafeFile, copy_nofollow, sha256_file
from build.errors import BuildFailure
from contracts import atomic
from contracts.schema import InvalidInput, Problem

LOCK_NAME = "debs.lock.json"
LOCK_FORMAT = 1
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
ARCH = "amd64"
PACKAGE_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]{0,99}")
VERSION = re.compile(r"[A-Za-z0-9.+~:-]{1,100}")
POOL_PATH = re.compile(r"pool/[A-Za-z0-9._+~/-]{1,300}\.deb")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# the index fields debootstrap reads to resolve and order an installation
INDEX_FIELDS = ("Package", "Version", "Architecture", "Priority", "Essential", "Multi-Arch", "Section",
                "Pre-Depends", "Depends", "Provides", "Breaks", "Conflicts", "Replaces")
FIELD_VALUE = re.compile(r"[^\n\x00]{0,4000}")


class DebLockErrors(InvalidInput):
    title = "the deb lock"


@dataclass(frozen=True)
class LockedDeb:
    package: str
    version: str
    architecture: str
    filename: str      # its path in the mirror (pool/...)
    size: int
    sha256: str
    fields: dict[str, str]   # the index stanza's fields debootstrap reads

    @property
    def basename(self) -> str:
        return self.filename.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class DebLock:
    base: str
    suite: str
    mirror: str
    release_date: str          # the Date of the verified InRelease: the base's time
    inrelease_sha256: str
    debs: tuple[LockedDeb, ...]

    def to_json(self) -> str:
        data = {"format": LOCK_FORMAT, **asdict(self)}
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def lock_path(base_dir: Path) -> Path:
    return Path(base_dir) / LOCK_NAME


def load_lock(base_dir: Path) -> DebLock | None:
    """The base's lock, every field checked (it is input like any spec); None when there is none."""
    path = lock_path(base_dir)
    if not path.is_file():
        return None
    shown = str(path)
    try:
        if path.stat().st_size > 16 << 20:
            raise ValueError("it is over 16 MiB")
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DebLockErrors([Problem(shown, "-", f"cannot be read: {exc}", "restore it from git, or "
                                     "`python -m build bases update` it", "bad-lock")]) from None
    problems = []

    def bad(where: str, what: str) -> None:
        problems.append(Problem(shown, where, what, "restore the file from git, or re-pin it with "
                                "`python -m build bases update BASE_DIR` and review the change", "bad-lock"))

    if not isinstance(data, dict) or data.get("format") != LOCK_FORMAT:
        bad("format", f"is not deb lock format {LOCK_FORMAT}")
        raise DebLockErrors(problems)
    debs = []
    for i, entry in enumerate(data.get("debs") if isinstance(data.get("debs"), list) else []):
        where = f"debs[{i}]"
        try:
            deb = LockedDeb(package=str(entry["package"]), version=str(entry["version"]),
                            architecture=str(entry["architecture"]), filename=str(entry["filename"]),
                            size=int(entry["size"]), sha256=str(entry["sha256"]),
                            fields={str(k): str(v) for k, v in dict(entry["fields"]).items()})
        except (KeyError, TypeError, ValueError):
            bad(where, "lacks package, version, architecture, filename, size, sha256 or fields")
            continue
        checks = ((PACKAGE_NAME, deb.package, "package"), (VERSION, deb.version, "version"),
                  (POOL_PATH, deb.filename, "filename"), (SHA256_HEX, deb.sha256, "sha256"))
        for pattern, value, name in checks:
            if not pattern.fullmatch(value) or (name == "filename" and ".." in value.split("/")):
                bad(f"{where}.{name}", f"{value[:80]!r} is not a valid {name}")
        if deb.architecture not in (ARCH, "all") or not 0 < deb.size < 1 << 31:
            bad(where, f"architecture {deb.architecture!r} or size {deb.size} is not possible here")
        if set(deb.fields) - set(INDEX_FIELDS) or any(not FIELD_VALUE.fullmatch(v) for v in deb.fields.values()):
            bad(f"{where}.fields", "holds a field debootstrap does not read, or a value with a newline")
        debs.append(deb)
    if not debs:
        bad("debs", "names no package")
    for name in ("base", "suite", "mirror", "release_date", "inrelease_sha256"):
        if not isinstance(data.get(name), str) or "\n" in data[name]:
            bad(name, "is missing or not one line of text")
    if problems:
        raise DebLockErrors(problems)
    return DebLock(base=data["base"], suite=data["suite"], mirror=data["mirror"], release_date=data["release_date"],
                   inrelease_sha256=data["inrelease_sha256"], debs=tuple(sorted(debs, key=lambda d: d.package)))


# ---- the cache and the local repository -----------------------------------------------------------

def deb_path(cache: CacheLayout, deb: LockedDeb) -> Path:
    return cache.root / "debs" / deb.sha256[:2] / deb.sha256 / deb.basename


def fetch(url: str, dest: Path, *, max_bytes: int) -> None:
    import requests  # comes with the docker SDK: `--plan` and `kernels build-here` load this module without it

    try:
        with requests.get(url, stream=True, timeout=60) as answer:
            if answer.status_code != 200:
                raise BuildFailure(f"{url} answered HTTP {answer.status_code}",
                                   "the mirror no longer serves this version: `python -m build bases import DIR` "
                                   "from an export that holds it, or re-pin with `bases update` (reviewed)")
            with dest.open("wb") as fh:
                got = 0
                for chunk in answer.iter_content(1 << 20):
                    got += len(chunk)
                    if got > max_bytes:
                        raise BuildFailure(f"{url} sent more than {max_bytes} bytes", "check the mirror in base.yaml")
                    fh.write(chunk)
    except requests.exceptions.RequestException as exc:
        raise BuildFailure(f"cannot download {url}: {str(exc).split('(Caused by')[0][:200]}",
                           "check the network and the mirror in base.yaml, or import an export") from None


def ensure_debs(lock: DebLock, cache: CacheLayout, log) -> list[Path]:
    """Every locked .deb in the cache, each checked against the lock; returns their paths."""
    paths = []
    for deb in lock.debs:
        target = deb_path(cache, deb)
        if not target.is_file() or target.stat().st_size != deb.size:
            url = f"{lock.mirror.rstrip('/')}/{deb.filename}"
            _store(deb, target, url, lambda partial, url=url, size=deb.size: fetch(url, partial, max_bytes=size))
            log.emit("bootstrap", f"fetched {deb.basename}")
        paths.append(target)
    return paths


def _store(deb: LockedDeb, target: Path, source: str, fill) -> None:
    """`fill(partial)` writes the .deb beside `target`; it is published only if its sha256 is the
    lock's, so the cache never holds a file the lock does not pin."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".tmp-", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        fill(partial)
        _check(partial, deb, source=source)
        partial.chmod(0o644)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _check(path: Path, deb: LockedDeb, *, source: str) -> None:
    got = sha256_file(path)
    if got != deb.sha256:
        raise DebLockErrors([Problem(LOCK_NAME, deb.package, f"{source} has sha256 {got[:16]}..., but the lock "
                                     f"pins {deb.sha256[:16]}... for {deb.package} {deb.version}",
                                     "the mirror or the export serves other bytes than were reviewed: fetch from a "
                                     "trusted mirror, or re-pin with `python -m build bases update` and review the "
                                     "change", "deb-sha256")])


def write_repository(lock: DebLock, debs: list[Path], root: Path) -> str:
    """A local apt repository holding exactly the locked .debs; returns its file:// URL."""
    pool = root / "pool"
    pool.mkdir(parents=True)
    stanzas = []
    for deb, path in zip(lock.debs, debs, strict=True):
        if _same_fs(path, pool):
            os.link(path, pool / deb.basename)
        else:
            shutil.copyfile(path, pool / deb.basename)
        fields = {k: deb.fields[k] for k in INDEX_FIELDS if k in deb.fields}
        fields.update({"Filename": f"pool/{deb.basename}", "Size": str(deb.size), "SHA256": deb.sha256})
        stanzas.append("".join(f"{k}: {v}\n" for k, v in fields.items()))
    packages = "".join(stanza + "\n" for stanza in stanzas).encode()   # each stanza ends in a blank line:
    # debootstrap's parser emits a stanza only when it meets the blank line after it
    index_dir = root / "dists" / lock.suite / "main" / f"binary-{ARCH}"
    index_dir.mkdir(parents=True)
    (index_dir / "Packages").write_bytes(packages)
    release = (f"Origin: ftimage deb lock\nSuite: {lock.suite}\nCodename: {lock.suite}\nDate: {lock.release_date}\n"
               f"Architectures: {ARCH}\nComponents: main\nSHA256:\n"
               f" {hashlib.sha256(packages).hexdigest()} {len(packages)} main/binary-{ARCH}/Packages\n")
    (root / "dists" / lock.suite / "Release").write_text(release)
    return f"file://{root}"


def _same_fs(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


# ---- bases update: pin what the mirror serves now, from its signed index --------------------------

def verified_release(mirror: str, suite: str, work: Path) -> tuple[str, bytes]:
    """The InRelease text after gpgv checked it with Debian's archive keyring, and its raw bytes."""
    raw = work / "InRelease"
    fetch(f"{mirror.rstrip('/')}/dists/{suite}/InRelease", raw, max_bytes=4 << 20)
    if not KEYRING.is_file():
        raise BuildFailure(f"{KEYRING} is missing, so the mirror's index cannot be verified",
                           "`apt-get install -y debian-archive-keyring`")
    done = subprocess.run(["gpgv", "--keyring", str(KEYRING), "--output", "-", str(raw)], capture_output=True,
                          timeout=60)
    if done.returncode != 0:
        raise BuildFailure(f"the InRelease of {mirror} {suite} does not verify with Debian's archive keyring: "
                           f"{done.stderr.decode(errors='replace').strip()[-300:]}",
                           "use an official Debian mirror (or one that mirrors its signed files unchanged)")
    return done.stdout.decode(), raw.read_bytes()


def parse_stanzas(text: str) -> list[dict[str, str]]:
    stanzas, current, key = [], {}, None
    for line in text.splitlines():
        if not line.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
        elif line[0] in " \t" and key:
            current[key] += "\n" + line
        elif ":" in line:
            key, _, value = line.partition(":")
            current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


def packages_index(mirror: str, release: str, suite: str, work: Path) -> dict[str, dict[str, str]]:
    """Package name -> stanza from main/binary-amd64/Packages.xz, checked against the release."""
    name = f"main/binary-{ARCH}/Packages.xz"
    sha_section = release.split("\nSHA256:\n", 1)[-1]
    match = re.search(rf"^ ([0-9a-f]{{64}}) +(\d+) {re.escape(name)}$", sha_section, re.M)
    if not match:
        raise BuildFailure(f"the verified InRelease lists no sha256 for {name}", "use an official Debian mirror")
    path = work / "Packages.xz"
    fetch(f"{mirror.rstrip('/')}/dists/{suite}/{name}", path, max_bytes=int(match.group(2)))
    if sha256_file(path) != match.group(1):
        raise BuildFailure(f"{name} from {mirror} does not match the sha256 its signed InRelease gives",
                           "the mirror is corrupt or tampered with: use another")
    return {s["Package"]: s for s in parse_stanzas(lzma.decompress(path.read_bytes()).decode()) if "Package" in s}


def resolve_names(base, work: Path) -> list[str]:
    """The packages debootstrap installs for this base (its --print-debs list)."""
    cmd = ["debootstrap", f"--variant={base.variant}", f"--include={','.join(sorted(base.packages))}",
           "--print-debs", base.suite, str(work / "resolve"), base.mirror]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise BuildFailure(f"debootstrap could not resolve {base.name}: {done.stderr.strip()[-400:]}",
                           "check the package names in base.yaml and that the mirror is reachable (as root)")
    return sorted(set(done.stdout.split()))


def update_lock(base, log) -> DebLock:
    with tempfile.TemporaryDirectory(prefix="ftimage-debs-") as tmp:
        work = Path(tmp)
        release, raw = verified_release(base.mirror, base.suite, work)
        date = next((line[5:].strip() for line in release.splitlines() if line.startswith("Date:")), "")
        index = packages_index(base.mirror, release, base.suite, work)
        names = resolve_names(base, work)
        missing = [n for n in names if n not in index]
        if missing:
            raise BuildFailure(f"debootstrap chose packages the signed index lacks: {', '.join(missing[:10])}",
                               "the mirror changed between the two reads: run `bases update` again")
        debs = tuple(LockedDeb(package=n, version=index[n]["Version"], architecture=index[n]["Architecture"],
                               filename=index[n]["Filename"], size=int(index[n]["Size"]), sha256=index[n]["SHA256"],
                               fields={k: " ".join(index[n][k].split()) for k in INDEX_FIELDS if k in index[n]})
                     for n in names)
    log.emit("bases", f"{base.name}: {len(debs)} packages pinned from {base.mirror} {base.suite} ({date})")
    return DebLock(base=base.name, suite=base.suite, mirror=base.mirror, release_date=date,
                   inrelease_sha256=hashlib.sha256(raw).hexdigest(), debs=debs)


def write_lock(base_dir: Path, lock: DebLock) -> Path:
    path = lock_path(base_dir)
    atomic.write_text(path, lock.to_json())
    return path


# ---- export / import ------------------------------------------------------------------------------

def export_debs(locks: list[DebLock], cache: CacheLayout, directory: Path, log) -> int:
    """Copy every locked .deb (fetched first if needed) and the locks into `directory`. Each is
    written to a temporary name there and renamed into place, so a name planted in the folder (a
    link to a file elsewhere) is never written through; a link is refused rather than replaced.
    The bytes copied are the lock's, hashed as they are copied from the cache."""
    directory.mkdir(parents=True, exist_ok=True)
    count = 0
    manifest = {}
    for lock in locks:
        for deb, path in zip(lock.debs, ensure_debs(lock, cache, log), strict=True):
            _export_one(deb, path, directory / deb.basename)
            manifest[deb.basename] = deb.sha256
            count += 1
    atomic.write_text(directory / "debs-manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return count


def _export_one(deb: LockedDeb, cached: Path, target: Path) -> None:
    if target.is_symlink():
        raise DebLockErrors([Problem(str(target.parent), deb.basename, f"{target} is a symbolic link to "
                                     f"{os.path.realpath(target)}: an export never writes through one",
                                     f"remove {target}, or export into a new folder", "deb-not-a-file")])
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    os.close(fd)
    partial = Path(tmp)
    try:
        partial.unlink()     # copy_nofollow creates its file anew, refusing any name already there
        copy_nofollow(cached, partial, size=deb.size, sha256=deb.sha256)
        os.replace(partial, target)
    except UnsafeFile as exc:     # a damaged cache entry: evicted, so the next run fetches it again
        cached.unlink(missing_ok=True)
        raise DebLockErrors([Problem(LOCK_NAME, deb.package, f"the cached {exc}; it was removed from the cache",
                                     "export again: the .deb is fetched again and checked against the lock",
                                     "deb-sha256")]) from None
    finally:
        partial.unlink(missing_ok=True)


def import_debs(locks: list[DebLock], cache: CacheLayout, directory: Path) -> int:
    """Take from `directory` the .debs the committed locks pin, each re-hashed; nothing else is
    read, so an export cannot bring in a package no reviewed lock names."""
    imported = 0
    for lock in locks:
        for deb in lock.debs:
            source = directory / deb.basename
            if source.is_symlink() or (source.exists() and not source.is_file()):
                raise DebLockErrors([Problem(str(directory), deb.basename, f"{source} is a symbolic link or not a "
                                             "regular file: an import reads only the files themselves",
                                             "copy the real .deb files into the export folder (no links)",
                                             "deb-not-a-file")])
            if not source.is_file():
                continue
            if source.stat().st_size != deb.size:   # refused before a byte is copied (a sparse 1 GiB file, say)
                raise DebLockErrors([Problem(str(directory), deb.basename, f"{source} holds {source.stat().st_size} "
                                             f"bytes, but the lock pins {deb.size} for {deb.package} {deb.version}",
                                             "export the bases again (`python -m build bases export DIR`), or re-pin "
                                             "with `python -m build bases update` and review the change",
                                             "deb-size")])
            _store(deb, deb_path(cache, deb), str(source), lambda partial, src=source, d=deb: _copy_in(src, partial, d))
            imported += 1
    return imported


def _copy_in(source: Path, partial: Path, deb: LockedDeb) -> None:
    """The checks above looked at the file; this reads it no further than the lock's size, and
    never through a link put in its place since."""
    partial.unlink()     # copy_nofollow creates its file anew
    try:
        copy_nofollow(source, partial, size=deb.size)
    except UnsafeFile as exc:
        raise DebLockErrors([Problem(str(source.parent), deb.basename, f"{exc} (it changed while it was imported)",
                                     "make sure nothing writes to the export folder, then import again",
                                     "deb-not-a-file")]) from None
