"""A local dataset folder's splits, resolved as `datasets.load_dataset(<folder>)` resolves them,
offline: the `configs:` of its README.md front matter first (the default config's `data_files`,
under its `data_dir`), else `datasets`' own data-files patterns (`data/<split>-00000-of-00003-<hash>
.parquet` shards, `train.jsonl` and `test.jsonl`, `train/` and `test/` folders, ...). The patterns
are resolved by `datasets` itself (datasets.data_files), hidden files and folders left out.

The README is hostile input. Its front matter is read bounded (the first 1 MiB of a regular
file) and parsed by contracts/safe_yaml.py (no anchors, no duplicate keys, bounded depth), and
every path it names must stay inside the folder: no absolute path, no `..`, no URL, and no
file, reached through a symlink or not, that lies outside the folder.
"""
from __future__ import annotations

import os
import stat
from glob import has_magic
from pathlib import Path, PurePosixPath

from contracts import safe_yaml
from contracts.errors import FixableError
from entrypoint.data.linked_files import inside, refuse_leaving
from entrypoint.inputs import check_data_path

README = "README.md"
FRONT_MATTER_LIMIT = safe_yaml.MAX_FILE_BYTES


class FolderRefused(FixableError):
    """The folder's declared layout is unusable; sources.py turns it into a DataError on its field."""

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def _read_readme(folder: Path, root: Path) -> str:
    path = folder / README
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise FolderRefused(f"{path} cannot be read: {exc.strerror}", "check its permissions") from None
    if not stat.S_ISREG(st.st_mode) or not inside(path, root, str(folder)):
        raise FolderRefused(f"{path} is not a regular file inside {folder}", "make README.md a plain file of the "
                            "dataset folder, or remove it")
    with open(path, "rb") as fh:
        head = fh.read(FRONT_MATTER_LIMIT + 1)
    return head.decode("utf-8", "replace")


def front_matter(folder: Path, root: Path) -> dict:
    """The README's YAML front matter (between a first line `---` and the next `---`), or {}."""
    text = _read_readme(folder, root)
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        return {}
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), None)
    if end is None:
        raise FolderRefused(f"{folder / README}: its front matter has no closing `---` within the first "
                            f"{FRONT_MATTER_LIMIT >> 20} MiB", "close the YAML front matter with a line `---`")
    try:
        data = safe_yaml.loads("".join(lines[1:end]))
    except safe_yaml.YamlRefused as exc:
        where = f" at {exc.where}" if exc.where else ""
        raise FolderRefused(f"{folder / README}: its front matter is refused: {exc.problem}{where}", exc.fix) \
            from None
    return data if isinstance(data, dict) else {}


def _relative(value, folder: Path, what: str) -> str:
    """A path or pattern from the README, refused unless it names something inside the folder."""
    if not isinstance(value, str) or not value.strip():
        raise FolderRefused(f"{folder / README}: {what} {value!r} is not a path", "write each path as a string "
                            "relative to the dataset folder, e.g. data/train-*")
    pure = PurePosixPath(value)
    if "://" in value or "::" in value or pure.is_absolute() or value.startswith("~") or ".." in pure.parts \
            or "\\" in value:
        raise FolderRefused(f"{folder / README}: {what} {value!r} leaves the dataset folder",
                            "name files inside the folder, relative to it (no absolute path, `..` or URL)")
    return value


def _default_config(configs, folder: Path) -> dict:
    from datasets.utils.metadata import MetadataConfigs  # see splits()

    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise FolderRefused(f"{folder / README}: `configs:` is not a list of mappings",
                            "write `configs: [{config_name: default, data_files: ...}]`, or remove it")
    plain = [{k: v for k, v in c.items() if k != "features"} for c in configs]   # features are not ours to parse
    try:
        declared = MetadataConfigs.from_dataset_card_data({"configs": plain})
        name = declared.get_default_config_name()
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise FolderRefused(f"{folder / README}: `configs:` is refused: {str(exc).strip().splitlines()[0][:200]}",
                            "give each config a config_name and data_files (a pattern, a list of them, or "
                            "[{split, path}])") from None
    if name is None:
        raise FolderRefused(f"{folder / README} declares configs {', '.join(map(str, declared))} and none is the "
                            "default", "mark one `default: true`, or point data.path at that config's files "
                            "(a folder or a glob)")
    return declared[name]


def _patterns(config: dict, folder: Path) -> tuple[dict[str, list[str]] | None, Path]:
    """(split -> patterns, or None for datasets' defaults; the folder they are relative to)."""
    from datasets.data_files import sanitize_patterns  # see splits()

    base = folder
    if config.get("data_dir") is not None:
        base = folder / _relative(config["data_dir"], folder, "data_dir")
    if config.get("data_files") is None:
        return None, base
    try:
        patterns = sanitize_patterns(config["data_files"])
    except (ValueError, TypeError, KeyError, AttributeError):
        raise FolderRefused(f"{folder / README}: data_files is not a pattern, a list of them or [{{split, path}}]",
                            "write e.g. `data_files: [{split: train, path: data/train-*}]`") from None
    return {split: [_relative(p, folder, f"the path of split {split!r}") for p in items]
            for split, items in patterns.items()}, base


def _visible(path: str, base: Path) -> bool:
    try:
        parts = Path(path).relative_to(base).parts
    except ValueError:
        return False
    return not any(part.startswith(".") for part in parts)


def splits(folder: str | Path, field: str = "data.path") -> dict[str, list[str]]:
    """Split -> its data files (sorted, absolute), in the order the dataset declares its splits.
    Check the files of the split you read with split_files."""
    # datasets only for a dataset folder: every source goes through sources.py, which imports this module
    # in the launcher and in every worker
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    folder = Path(folder)
    root = Path(os.path.realpath(folder))
    meta = front_matter(folder, root)
    config = _default_config(meta["configs"], folder) if meta.get("configs") else {}
    patterns, base = _patterns(config, folder)
    base = Path(os.path.realpath(base))
    if not inside(base, root, str(folder)) or not base.is_dir():
        raise FolderRefused(f"{folder / README}: data_dir is not a folder inside {folder}",
                            "set data_dir to a folder of the dataset, relative to it")
    for pattern in (p for items in (patterns or {}).values() for p in items if not has_magic(p)):
        check_data_path(str(base / pattern), field)   # a FIFO named by the README: refused, never opened
    try:
        if patterns is None:
            patterns = get_data_patterns(str(base))
        resolved = DataFilesDict.from_patterns(patterns, base_path=str(base))
    except EmptyDatasetError:
        return {}
    except FileNotFoundError as exc:
        raise FolderRefused(f"{folder}: a split's data files are missing ({str(exc).splitlines()[0][:200]})",
                            "check the paths in README.md's `configs:` against the files in the folder") from None
    except ValueError as exc:
        raise FolderRefused(f"{folder}: {str(exc).splitlines()[0][:200]}", "name the split files "
                            "<split>-00000-of-00001.<ext> with a split made of letters, digits and _") from None
    return {str(split): sorted(str(p) for p in files) for split, files in resolved.items()}


def split_files(folder: str | Path, split: str, files: list[str]) -> list[str]:
    """One split's files, each checked: inside the folder (symlinks resolved), never hidden."""
    root = Path(os.path.realpath(folder))
    refuse_leaving(files, root, f"split {split!r} of {folder}")   # LinkRefused: sources.py names the field
    visible = [p for p in files if _visible(p, root)]
    if files and not visible:
        raise FolderRefused(f"split {split!r} of {folder} names only hidden files ({Path(files[0]).name}, ...): "
                            "hidden files are never read", "rename them without the leading `.`, or point the "
                            "split at other files")
    return visible


__all__ = ["FolderRefused", "README", "front_matter", "split_files", "splits"]
