"""The venv layer: the hash-locked wheels installed with `installer`, no pip, no `docker build`.

  1. a venv skeleton written as files (pyvenv.cfg, bin/python -> the base's python3, lib64);
  2. each wheel checked against the lock's sha256 and its own RECORD, then installed;
  3. static archives dropped with their RECORD rows (nothing loads them at run time);
  4. the `.pth` that puts the image's own code on the path;
  5. the equivalent of `pip check` over what was installed (depcheck.py);
  6. checked-hash .pyc compiled by the runtime base's own interpreter, in a container with no
     network, PYTHONHASHSEED=0 (marshal writes set constants in hash order) and the staged
     folder mounted where it will live in the image; each .pyc is added to its RECORD, as pip
     does, so verify hashes it.

The layer's time is the build time of its newest wheel (read from the wheels' zip entries),
capped by SOURCE_DATE_EPOCH: a new commit does not change it.
"""
from __future__ import annotations

import base64
import calendar
import csv
import hashlib
import io
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import installer
from installer.destinations import SchemeDictionaryDestination
from installer.records import RecordEntry
from installer.sources import WheelFile

import guard
from build.cache import sha256_file
from build.context.drop_installed_files import drop
from build.errors import BuildFailure
from build.oci import depcheck
from build.oci.layercache import CachedLayer, LayerCache, layer_key
from build.oci.tarlayer import parents, tree_entries, write_layer
from build.source_date import parse_epoch
from contracts.events import EventLog, Progress

DROPPED_FILES = ("*.a",)
INSTALLER_NAME = b"ftimage\n"

# Run by the base's python3 with the staged venv mounted at its image path. A constant: no
# spec value is ever part of it.
COMPILE_SCRIPT = """
import compileall, os, sys
print("PYTHON", sys.version.split()[0], sys.implementation.cache_tag, flush=True)
compileall.compile_dir(sys.argv[1], ddir=sys.argv[2], quiet=1, workers=os.cpu_count() or 1,
                       invalidation_mode=compileall.py_compile.PycInvalidationMode.CHECKED_HASH)
"""


@dataclass(frozen=True)
class LockedWheel:
    filename: str
    sha256: str
    path: Path


def wheels_epoch(wheels: list[LockedWheel]) -> int:
    """The newest entry time in any of the wheels (zip times are UTC by convention)."""
    newest = 0
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel.path) as archive:
                for info in archive.infolist():
                    newest = max(newest, calendar.timegm((*info.date_time, 0, 0, 0)))
        except (OSError, zipfile.BadZipFile) as exc:
            raise BuildFailure(f"{wheel.filename} in the cache is not a readable wheel ({exc})",
                               "delete its cache entry (or use a fresh --cache); it is downloaded again") from None
    return newest


def capped(epoch: int) -> int:
    env = os.environ.get("SOURCE_DATE_EPOCH")
    if env is None:
        return epoch
    return min(epoch, parse_epoch(env))


def venv_key(wheels: list[LockedWheel], *, venv: str, app_dir: str, python_minor: str, base_diff_ids: list[str],
             epoch: int) -> str:
    """The venv layer's cache key (also what `--plan` computes before building): the wheels, the
    base layers under it, the runtime guard, and how it is installed and compiled."""
    return layer_key("venv", {
        "wheels": sorted([w.filename, w.sha256] for w in wheels), "venv": venv, "pth": app_dir,
        "guard": {name: data.decode() for name, data in sorted(guard.install_files().items())},
        "python": python_minor, "base": base_diff_ids, "dropped": list(DROPPED_FILES), "mtime": epoch,
        "installer": installer.__version__, "compile": hashlib.sha256(COMPILE_SCRIPT.encode()).hexdigest()})


def venv_layer(*, engine, cache: LayerCache, scratch: Path, wheels: list[LockedWheel], venv: str, app_dir: str,
               python_minor: str, base_ref: str | Callable[[], str], base_diff_ids: list[str], log: EventLog,
               wheels_time: int | None = None, fetch_wheels: Callable[[], None] | None = None) -> CachedLayer:
    """`wheels_time`: wheels_epoch(wheels), when the caller has read it already (or a registry
    entry told it, and the files are not here). `base_ref`: the runtime base's ref, or what puts
    it in the engine; `fetch_wheels`: what puts the wheel files in the cache. Both are called only
    when the layer is made here, not found in a cache."""
    epoch = capped(wheels_epoch(wheels) if wheels_time is None else wheels_time)
    key = venv_key(wheels, venv=venv, app_dir=app_dir, python_minor=python_minor, base_diff_ids=base_diff_ids,
                   epoch=epoch)

    def make(path: Path):
        if fetch_wheels is not None:
            fetch_wheels()
        base = base_ref if isinstance(base_ref, str) else base_ref()
        stage = scratch / "venv"
        _install(stage, wheels, venv, python_minor, log)
        site = stage / "lib" / f"python{python_minor}" / "site-packages"
        dropped = drop(site, list(DROPPED_FILES))
        log.emit("venv", f"dropped {len(dropped)} static archive(s) with their RECORD rows")
        (site / guard.APP_PTH).write_text(app_dir + "\n")
        for name, data in guard.install_files().items():   # the runtime guard, in every process of the venv
            (site / name).write_bytes(data)
        version, cache_tag = _compile(engine, base, stage, venv, python_minor, log)
        problems = depcheck.dependency_problems(site, version)
        if problems:
            raise BuildFailure("the locked wheels do not satisfy each other:\n  " + "\n  ".join(problems[:20]),
                               "add or re-pin the named packages in image.yaml's python.requirements")
        _record_bytecode(site, cache_tag)
        (stage / "pyvenv.cfg").write_text(
            f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {version}\n"
            f"executable = /usr/bin/python{python_minor}\ncommand = /usr/bin/python3 -m venv {venv}\n")
        log.emit("venv", "writing the venv layer")
        return write_layer(path, [*parents(venv), *tree_entries(stage, venv)], epoch)

    return cache.get_or_make(key, "venv", f"ftimage venv: {len(wheels)} hash-locked wheels in {venv}", epoch, make)


def _install(stage: Path, wheels: list[LockedWheel], venv: str, python_minor: str, log: EventLog) -> None:
    site = stage / "lib" / f"python{python_minor}" / "site-packages"
    site.mkdir(parents=True)
    (stage / "bin").mkdir()
    (stage / "lib64").symlink_to("lib")
    (stage / "bin" / "python3").symlink_to("/usr/bin/python3")
    (stage / "bin" / "python").symlink_to("python3")
    (stage / f"bin/python{python_minor}").symlink_to("python3")
    progress = Progress(log, "venv", "install", min_interval=5.0)
    for done, wheel in enumerate(sorted(wheels, key=lambda w: w.filename)):
        if sha256_file(wheel.path) != wheel.sha256:
            raise BuildFailure(f"{wheel.filename} in the cache does not match the lock's sha256 {wheel.sha256[:16]}",
                               "delete the cache entry (or run with a fresh --cache); it is downloaded again")
        name = wheel.filename.split("-")[0]
        scheme = {"purelib": str(site), "platlib": str(site), "scripts": str(stage / "bin"), "data": str(stage),
                  "headers": str(stage / "include" / "site" / f"python{python_minor}" / name)}
        destination = SchemeDictionaryDestination(scheme, interpreter=f"{venv}/bin/python", script_kind="posix",
                                                  bytecode_optimization_levels=(), overwrite_existing=True)
        try:
            with WheelFile.open(wheel.path) as source:
                source.validate_record()
                installer.install(source, destination, {"INSTALLER": INSTALLER_NAME})
        except (installer.exceptions.InstallerError, zipfile.BadZipFile, ValueError) as exc:
            raise BuildFailure(f"{wheel.filename} cannot be installed: {exc}",
                               "the wheel is damaged or not a wheel: delete its cache entry and build again") from None
        progress.update(done + 1, wheel.filename[:80], total=len(wheels))
    progress.finish(f"installed {len(wheels)} wheels")


def _compile(engine, base_ref: str, stage: Path, venv: str, python_minor: str, log: EventLog) -> tuple[str, str]:
    site = f"{venv}/lib/python{python_minor}/site-packages"
    # argv[2]: the path each .pyc names as its source, whatever folder the compiler sees
    result = engine.run(base_ref, ["python3", "-c", COMPILE_SCRIPT, site, site], network="none",
                        volumes={str(stage): {"bind": venv, "mode": "rw"}},
                        environment={"PYTHONHASHSEED": "0", "SOURCE_DATE_EPOCH": "0"},
                        user=f"{os.getuid()}:{os.getgid()}", entrypoint=[], timeout=3600)
    first = next((line for line in result.output.splitlines() if line.startswith("PYTHON ")), "")
    fields = first.split()
    if result.exit_code != 0 or len(fields) != 3:
        raise BuildFailure(f"compiling the venv's .pyc with the base's python3 failed (exit {result.exit_code}):\n"
                           + "\n".join(result.output.splitlines()[-15:]), "check that the runtime base has python3")
    version, cache_tag = fields[1], fields[2]
    if ".".join(version.split(".")[:2]) != python_minor:
        raise BuildFailure(f"the runtime base's python3 is {version}, but the toolchain's wheels are for "
                           f"Python {python_minor}", "use a base whose python3 matches the toolchain")
    log.emit("venv", f"compiled checked-hash .pyc with the base's Python {version}")
    return version, cache_tag


def _record_bytecode(site: Path, cache_tag: str) -> None:
    """Add each compiled .pyc to the RECORD of the distribution that owns its source."""
    for record in sorted(site.glob("*.dist-info/RECORD")):
        rows = list(csv.reader(io.StringIO(record.read_text(encoding="utf-8"))))
        listed = {row[0] for row in rows if row}
        added = []
        for row in rows:
            if not row or not row[0].endswith(".py"):
                continue
            source = Path(row[0])
            pyc = (source.parent / "__pycache__" / f"{source.stem}.{cache_tag}.pyc").as_posix()
            target = site / pyc
            if pyc in listed or not target.is_file():
                continue
            data = target.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            added.append(RecordEntry(pyc, installer.records.Hash("sha256", digest), len(data)))
        if added:
            out = io.StringIO()
            writer = csv.writer(out, lineterminator="\n")
            writer.writerows(row for row in rows if row)
            writer.writerows(entry.to_row() for entry in added)
            record.write_text(out.getvalue(), encoding="utf-8")
