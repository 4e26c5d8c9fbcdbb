"""Resolve an image's Python dependencies once, on the host, into a content-addressed wheelhouse.

The full closure (requirements + the toolchain's exact torch wheel) is resolved with
`pip download` for the image's Python and platform, every file is hashed and stored under
its sha256, and the resolution itself is cached. The image's venv is installed from exactly
these files, each checked against the lock's sha256: by `installer` in the assembler
(build/oci/venv.py), or by pip with `--no-index --require-hashes` and networking disabled in
the classic builder's Dockerfile. Kernel builder images install their build closure from it too.
"""
from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import stat
import sys
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from build import proc
from build.cache import CacheLayout, UnsafeFile, digest_nofollow, sha256_file
from build.errors import BuildFailure
from build.resolve import BuildPlan, digest
from contracts import atomic
from contracts.events import EventLog, Progress

RECORD_SCHEMA = 3   # 3: versions come from each wheel's METADATA, not its file name

# glibc of the bootstrapped Debian bookworm bases is 2.36: accept manylinux tags up to it.
_GLIBC_MAX_MINOR = 36


@dataclass(frozen=True, kw_only=True)
class Wheel:
    name: str          # canonical distribution name
    version: str
    filename: str
    sha256: str
    size: int | None = None   # bytes; None in resolutions recorded before sizes were

    def requirement_line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True, kw_only=True)
class Resolution:
    key: str
    wheels: tuple[Wheel, ...]
    cache_hit: bool
    source: str = "local"         # "local" (the resolution cache), "index" (pip), "registry" (the remote cache)
    epoch: int | None = None      # the newest entry time in the wheels, when known without their files
    files: bool = True            # every wheel is in the cache (a registry resolution fetches none)


# (key, plan) -> (the closure, its wheels' newest entry time) from the remote cache, or None
RemoteResolution = Callable[[str, BuildPlan], "tuple[tuple[Wheel, ...], int] | None"]


def platform_tags(platform: str) -> list[str]:
    arch = platform.removeprefix("linux_")
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(_GLIBC_MAX_MINOR, 16, -1)]
    return tags + [f"manylinux2014_{arch}", f"linux_{arch}"]


def fill_wheelhouse(plan: BuildPlan, cache: CacheLayout, log: EventLog,
                    remote: RemoteResolution | None = None) -> Resolution:
    """The image's pinned closure (its requirements plus the toolchain's torch). With `remote`
    and no usable local resolution, the registry's resolution entry names the closure and its
    time, and no wheel is downloaded: `wheel_files` fetches them if a stage needs them after all
    (a venv layer to assemble, a Dockerfile build)."""
    key = resolution_key(plan.python_requirements, plan)
    if remote is not None and cached_resolution(plan, cache) is None:
        found = remote(key, plan)
        if found is not None:
            wheels, epoch = found
            atomic.write_json(cache.resolutions / f"{key}.json", resolution_record(wheels), indent=1, sort_keys=True)
            log.emit("wheelhouse", f"image: resolution from the registry, {len(wheels)} wheels named, none downloaded",
                     key=key[:12])
            return Resolution(key=key, wheels=wheels, cache_hit=False, source="registry", epoch=epoch, files=False)
    return resolve_closure(plan.python_requirements, plan=plan, cache=cache, log=log, purpose="image")


def wheel_files(resolution: Resolution, plan: BuildPlan, cache: CacheLayout, log: EventLog) -> Resolution:
    """`resolution` with every wheel in the cache: those missing are downloaded by their pinned
    name, version and sha256 (`pip download --no-deps --require-hashes`), never re-resolved, so
    the files are exactly the closure the registry's entry named."""
    if resolution.files:
        return resolution
    missing = [w for w in resolution.wheels if w.filename in verify_cached_wheels(resolution.wheels, cache, log)]
    if missing:
        log.emit("wheelhouse", f"image: downloading the {len(missing)} wheels a stage needs after all")
        _download_pinned(missing, plan, cache, log)
    return Resolution(key=resolution.key, wheels=resolution.wheels, cache_hit=False, source=resolution.source,
                      epoch=resolution.epoch, files=True)


def resolution_key(requirements: tuple[str, ...], plan: BuildPlan) -> str:
    return digest({"requirements": sorted(requirements),
                   "torch": {"version": plan.toolchain.torch_version, "sha256": plan.torch_wheel.sha256},
                   "python": plan.toolchain.python, "platform": plan.spec.platform, "schema": RECORD_SCHEMA})


def cached_resolution(plan: BuildPlan, cache: CacheLayout) -> tuple[Wheel, ...] | None:
    """The image's closure as the cache recorded it, if the record is intact and every wheel is
    there (not re-hashed: for `--plan`, which downloads and changes nothing); else None."""
    record = cache.resolutions / f"{resolution_key(plan.python_requirements, plan)}.json"
    wheels, _ = _read_resolution(record, plan) if record.is_file() else (None, "")
    if wheels is None or not all(cache.wheel_path(w.sha256, w.filename).is_file() for w in wheels):
        return None
    return wheels


def resolve_closure(requirements: tuple[str, ...], *, plan: BuildPlan, cache: CacheLayout, log: EventLog,
                    purpose: str) -> Resolution:
    """Resolve requirements + the pinned torch for the plan's Python and platform, downloading
    only on a resolution-cache miss. Every returned wheel is in the cache and re-verified."""
    key = resolution_key(requirements, plan)
    record = cache.resolutions / f"{key}.json"
    if record.is_file():
        wheels, problem = _read_resolution(record, plan)
        missing = verify_cached_wheels(wheels, cache, log) if wheels is not None else []
        if wheels is not None and not missing:
            log.emit("wheelhouse", f"{purpose}: resolution cache hit, {len(wheels)} wheels", key=key[:12])
            return Resolution(key=key, wheels=wheels, cache_hit=True)
        if problem:
            log.emit("wheelhouse", f"{purpose}: the cached resolution {record.name} is unusable ({problem}); "
                     "resolving again")
        if missing:  # e.g. evicted just now after failing its hash: fetch again rather than fail
            log.emit("wheelhouse", f"{purpose}: {len(missing)} cached wheel(s) missing, fetching again",
                     first=missing[0])
    log.emit("wheelhouse", f"{purpose}: resolving and downloading the Python closure with pip", key=key[:12])
    wheels = _download(requirements, plan, cache, log)
    atomic.write_json(record, resolution_record(wheels), indent=1, sort_keys=True)
    return Resolution(key=key, wheels=wheels, cache_hit=False, source="index")


# Wheels this process has hashed and found intact, with the identity of the file it hashed: a
# build resolves overlapping closures (the image's, each kernel builder's) and re-hashing
# gigabytes of torch for each would change nothing. Any write, rename, chmod or relink of the
# file changes its ctime or inode, and the wheel is hashed again.
_VERIFIED: dict[Path, tuple[str, tuple[int, ...]]] = {}


def _identity(path: Path) -> tuple[int, ...] | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) if stat.S_ISREG(st.st_mode) else None


def verify_cached_wheels(wheels: tuple[Wheel, ...], cache: CacheLayout, log: EventLog) -> list[str]:
    """The wheels not usable from the cache, which the caller downloads again in this build (each
    download is hashed as it is stored): those missing, and those damaged, each evicted and named
    in one WARN line. A damaged wheel is never used: a link or a FIFO is not read, one of another
    size than recorded is not hashed, and the rest are re-hashed, never further than their size."""
    paths = [cache.wheel_path(wheel.sha256, wheel.filename) for wheel in wheels]
    unusable = [w.filename for w, path in zip(wheels, paths) if not path.exists() and not path.is_symlink()]
    if unusable:
        return unusable    # the closure is downloaded again anyway: hashing the rest would be wasted
    for wheel, path in zip(wheels, paths):
        before = _identity(path)
        if before is not None and _VERIFIED.get(path) == (wheel.sha256, before):
            continue
        try:
            actual, _size = digest_nofollow(path, size=wheel.size)
            why = "" if actual == wheel.sha256 else f"sha256 {actual} is not the locked {wheel.sha256}"
        except UnsafeFile as exc:
            why = str(exc).removeprefix(f"{path} ")
        if not why and before is not None and _identity(path) == before:
            _VERIFIED[path] = (wheel.sha256, before)
        if why:
            if path.parent.is_symlink():
                path.parent.unlink()    # the link goes, never what it points to (rmtree follows none below)
            else:
                shutil.rmtree(path.parent, ignore_errors=True)
            log.emit("wheelhouse", f"WARN: cached wheel {path} is damaged ({why}): evicted, downloading it again")
            unusable.append(wheel.filename)
    return unusable


def _read_resolution(record: Path, plan: BuildPlan) -> tuple[tuple[Wheel, ...] | None, str]:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None, "unreadable"
    return parse_resolution(data, plan)


def resolution_record(wheels: tuple[Wheel, ...]) -> dict:
    """What the resolution cache stores of a closure (and a registry resolution entry carries)."""
    body = [asdict(w) for w in wheels]
    return {"schema": RECORD_SCHEMA, "wheels": body, "sha256": digest(body)}


def parse_resolution(data, plan: BuildPlan) -> tuple[tuple[Wheel, ...] | None, str]:
    """A record is used only if it is intact (its own sha256 matches) and holds the pinned torch:
    an edited, emptied or truncated record must never yield a torch-less image."""
    try:
        body = data["wheels"]
        if data.get("schema") != RECORD_SCHEMA or data.get("sha256") != digest(body):
            return None, "its own sha256 does not match: edited or truncated"
        wheels = tuple(Wheel(**w) for w in body)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None, "unreadable"
    for w in wheels:
        if not re.fullmatch(r"[0-9a-f]{64}", w.sha256) or "/" in w.filename or w.filename.startswith(".") or \
                not (w.size is None or (type(w.size) is int and 0 < w.size < 1 << 40)):
            return None, f"an invalid entry {w.filename[:40]!r}"
    if not any(w.name == "torch" and w.sha256 == plan.torch_wheel.sha256 for w in wheels):
        return None, "it does not hold the pinned torch wheel"
    return wheels, ""


def _download(requirements: tuple[str, ...], plan: BuildPlan, cache: CacheLayout,
              log: EventLog) -> tuple[Wheel, ...]:
    with cache.scratch_dir("download") as tmpdir:
        reqs = tmpdir / "requirements.in"
        reqs.write_text("\n".join([f"torch=={plan.toolchain.torch_version}", *requirements]) + "\n")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
               "--dest", str(tmpdir / "dl"), "--only-binary=:all:", "--implementation", "cp",
               "--python-version", plan.toolchain.python, "--abi", "cp" + plan.toolchain.python.replace(".", ""),
               "-r", str(reqs)]
        for tag in platform_tags(plan.spec.platform):
            cmd += ["--platform", tag]
        progress = Progress(log, "download", "pip", expected_seconds=60.0, min_interval=10.0)
        progress.update(None, f"pip download of {len(requirements) + 1} pinned requirements and their closure",
                        force=True)
        child = proc.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
        if child.returncode != 0:
            detail = "\n".join(line for line in child.stderr.splitlines() if "is ignored" not in line)[-2000:]
            raise BuildFailure(f"pip could not resolve the image's Python requirements:\n{detail}",
                               "check python.requirements in image.yaml against what your index serves")
        wheels = []
        for path in sorted((tmpdir / "dl").iterdir()):
            wheels.append(_store(path, cache))
        progress.finish(f"{len(wheels)} wheels downloaded and hashed")
    _check_torch_pin(plan, wheels)
    log.emit("wheelhouse", f"stored {len(wheels)} wheels", total_mb=round(sum(
        cache.wheel_path(w.sha256, w.filename).stat().st_size for w in wheels) / 2 ** 20))
    return tuple(sorted(wheels, key=lambda w: w.name))


def _download_pinned(wheels: list[Wheel], plan: BuildPlan, cache: CacheLayout, log: EventLog) -> None:
    with cache.scratch_dir("download") as tmpdir:
        reqs = tmpdir / "requirements.lock.txt"
        reqs.write_text(requirements_lock(tuple(wheels)))
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--require-hashes", "--dest", str(tmpdir / "dl"), "--only-binary=:all:", "--implementation", "cp",
               "--python-version", plan.toolchain.python, "--abi", "cp" + plan.toolchain.python.replace(".", ""),
               "-r", str(reqs)]
        for tag in platform_tags(plan.spec.platform):
            cmd += ["--platform", tag]
        child = proc.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
        if child.returncode != 0:
            raise BuildFailure(f"pip could not download the pinned wheels the registry's resolution names:\n"
                               f"{child.stderr[-2000:]}",
                               "check that your index still serves them, or build without --cache-registry")
        wanted = {w.sha256 for w in wheels}
        stored = {_store(path, cache).sha256 for path in sorted((tmpdir / "dl").iterdir())}
        if not wanted <= stored:
            raise BuildFailure(f"pip did not deliver {len(wanted - stored)} of the pinned wheels",
                               "check that your index still serves them, or build without --cache-registry")


def _store(path: Path, cache: CacheLayout) -> Wheel:
    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        raise BuildFailure(f"pip returned a non-wheel file {path.name}",
                           "every dependency must be available as a wheel for the image's platform") from None
    sha = sha256_file(path)
    dest = cache.wheel_path(sha, path.name)
    if not dest.is_file() or dest.is_symlink():   # a planted link is replaced, never kept as the entry
        atomic.copy_file(path, dest)
    return Wheel(name=str(canonicalize_name(name)), version=metadata_version(path) or str(version),
                 filename=path.name, sha256=sha, size=path.stat().st_size)


def metadata_version(wheel: Path) -> str | None:
    """The version the wheel installs (its METADATA), which is what importlib.metadata reports in
    the image and what verify compares with. It is not always torch.__version__: PyTorch's CUDA
    wheel installs metadata version 2.14.1 while torch.__version__ says 2.14.1+cu130."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                return None
            with zf.open(names[0]) as fh:
                head = fh.read(64 * 1024).decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile):
        return None
    return email.parser.Parser().parsestr(head, headersonly=True).get("Version")


def _check_torch_pin(plan: BuildPlan, wheels: list[Wheel]) -> None:
    for wheel in wheels:
        if wheel.name == "torch":
            if wheel.sha256 != plan.torch_wheel.sha256:
                raise BuildFailure(
                    f"pip served torch as {wheel.filename} with sha256 {wheel.sha256}, but toolchain "
                    f"{plan.toolchain.name} pins {plan.torch_wheel.filename} sha256 {plan.torch_wheel.sha256}",
                    "point pip at the index that serves the pinned torch wheel (e.g. --find-links), "
                    "or re-pin the toolchain after checking the new file")
            return
    raise BuildFailure("pip resolved no torch wheel", "check the toolchain's torch version")


def requirements_lock(wheels: tuple[Wheel, ...]) -> str:
    return "".join(w.requirement_line() + "\n" for w in sorted(wheels, key=lambda w: w.name))

