"""The files a data path reaches, with one rule for every form it takes (a file, a folder, a glob,
a dataset folder's split, a save_to_disk folder, a mixture source, the eval split): no file may be
reached through a link that leaves the root the user named.

The named path itself may be a link (the user chose it: Kubernetes volumes mount through links);
below it, a link to a file or a folder outside it is how a hostile dataset folder reads another
job's data or a secret. A glob's root is its literal prefix (`/data/*/train.jsonl` -> `/data`).
A dangling link among the data files is refused too: skipping it would drop data without a word.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from contracts.errors import FixableError

LEAVE_FIX = ("copy the data into one folder of real files (`cp -rL` resolves links; `huggingface-cli download "
             "REPO --repo-type dataset --local-dir DIR` writes real files) and point the field at it")


class LinkRefused(FixableError):
    """A data file reached through a link that leaves the named root, or a dangling link; sources.py
    reports it on its field."""


def real_path(path: str | Path, named: str) -> Path:
    """`path` with every link resolved; one that cannot be (a process's /proc link, a permission)
    is refused, never guessed."""
    try:
        return Path(os.path.realpath(path))
    except OSError as exc:
        raise LinkRefused(f"{named}: {path} cannot be resolved ({exc.strerror})",
                          "point the field at a folder of data files this job may read") from None


def link_target(link: str | Path, named: str) -> str:
    try:
        return os.readlink(link)
    except OSError as exc:
        raise LinkRefused(f"{named}: {link} cannot be resolved ({exc.strerror})",
                          "point the field at a folder of data files this job may read") from None


def inside(path: str | Path, real_root: Path, named: str = "data.path") -> bool:
    real = real_path(path, named)
    return real == real_root or real_root in real.parents


def leaving_link(path: Path, root: Path) -> Path | None:
    """The first link on the way down from `root` to `path` (itself included) whose target lies
    outside `root`'s real path; None when there is none (or `path` is not under `root`)."""
    real_root = real_path(root, str(root))
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return None
    here = root
    for part in parts:
        here = here / part
        if here.is_symlink() and not inside(here, real_root, str(root)):
            return here
    return None


def refuse_leaving(files: list[str], root: str | Path, named: str) -> None:
    """LinkRefused, naming the link, if any of `files` lies outside `root`'s real path."""
    root = Path(root)
    real_root = real_path(root, named)
    for file in files:
        if not os.path.lexists(file):
            continue
        target = link_target(file, named) if os.path.islink(file) else ""
        if target and not os.path.exists(file):
            raise LinkRefused(f"{named}: {file} is a link to {target}, which does not exist",
                              "remove the dangling link, or restore the file it names")
        if not inside(file, real_root, named):
            link = leaving_link(Path(file), root) or Path(file)
            raise LinkRefused(f"{named}: {link} is a link to {real_path(link, named)}, outside {root}; "
                              f"{file} is reached through it", LEAVE_FIX)


def walk(folder: str | Path, named: str) -> list[str]:
    """Every visible file under `folder` (hidden files and folders left out), sorted, following
    links that stay inside it; LinkRefused for a link that leaves it, and never a loop."""
    folder = Path(folder)
    real_root = real_path(folder, named)
    found: list[str] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        here = Path(dirpath)
        if not inside(here, real_root, named):
            link = leaving_link(here, folder) or here
            raise LinkRefused(f"{named}: {link} is a link to {real_path(link, named)}, outside {folder}; the "
                              f"files under it would be read", LEAVE_FIX)
        real = str(real_path(here, named))
        if real in seen:          # a link back up the tree: walked once already
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [str(here / name) for name in filenames if not name.startswith(".")]
    found.sort()
    refuse_leaving(found, folder, named)
    return found


def glob_root(pattern: str) -> Path:
    """The literal prefix of a glob: the folder its matches all lie under, as the user named it."""
    parts = Path(pattern).parts
    literal = [p for p in parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]]
    return Path(*literal) if literal else Path(".")


def glob_files(pattern: str, named: str) -> list[str]:
    """The files a glob matches (links followed only while they stay under its literal prefix)."""
    matches = sorted(glob.glob(pattern, recursive=True))
    root = glob_root(pattern)
    refuse_leaving([m for m in matches if os.path.islink(m) or os.path.isfile(m)], root, named)
    return [m for m in matches if os.path.isfile(m)]


__all__ = ["LinkRefused", "glob_files", "glob_root", "inside", "leaving_link", "refuse_leaving", "walk"]
