"""What every `python -m build` command shares: exit codes, the common options, the cache."""
from __future__ import annotations

import argparse
from pathlib import Path

from build import outdir
from build.cache import CacheLayout, default_cache_root

EXIT_OK, EXIT_BUILD_FAILED, EXIT_BAD_SPEC, EXIT_REFUSED = 0, 1, 2, 3


def add_common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-logs", action="store_true", help="progress as JSON lines on stderr (one event schema)")
    p.add_argument("--cache", type=Path, default=None, help="cache root (default: $FTIMAGE_CACHE or ~/.cache/ftimage)")
    p.add_argument("--manifest", type=Path, default=None, help="kernels manifest (default: ./kernels_manifest.yaml)")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder this tool did not create "
                   "(same-named files are overwritten; nothing else is deleted)")


def open_cache(path: Path | None, *, force: bool = False, write: bool = True) -> CacheLayout:
    root = Path(path or default_cache_root())
    if write:
        outdir.claim(root, outdir.CACHE_MARKER, what="cache folder", option="--cache or FTIMAGE_CACHE", force=force)
    elif root.exists() and not root.is_dir():
        raise outdir.UnsafeDirectory(f"cache folder {root} is a file", "point FTIMAGE_CACHE at a folder")
    cache = CacheLayout(root)
    if write:
        cache.sweep_scratch()
    return cache
