"""`python -m build IMAGE_DIR --render DIR`: write the build context (Dockerfile, hash-locked
wheelhouse, lock, SBOM, app) into a new or empty folder, and build nothing."""
from __future__ import annotations

from pathlib import Path

from build import context  # render_context loads on first use: a bare GPU host has no SBOM library (cyclonedx)
from build.cli.common import EXIT_OK, open_cache
from build.context import render_target
from build.resolve import BuildPlan
from build.wheelhouse import fill_wheelhouse
from contracts.events import EventLog


def render(plan: BuildPlan, target: Path, *, cache_root, log: EventLog, force: bool) -> int:
    render_target.check_render_target(target, force=force)   # before the cache is opened or filled
    cache = open_cache(cache_root, force=force)
    resolution = fill_wheelhouse(plan, cache, log)
    rendered = context.render_context(plan, target, wheels=resolution.wheels, cache=cache, force=force)
    print(f"rendered {rendered.files} files into {target} (context sha256 {rendered.digest[:16]})")
    print("note: compiled kernel wheels are added by a full build; bases are named, not bootstrapped")
    return EXIT_OK
