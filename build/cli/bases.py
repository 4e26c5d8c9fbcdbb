"""`python -m build bases update|export|import`: the deb locks that pin bootstrapped bases; and
`python -m build bootstrap-base BASE_DIR`: debootstrap one base (from its deb lock)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from build.base import debs_lock
from build.base.bootstrap import bootstrap
from build.cli.common import EXIT_OK, add_common_options, open_cache
from build.engine import connect
from build.spec import REPO_ROOT, SpecErrors, load_bootstrap_base
from contracts.events import EventLog
from contracts.schema import Problems


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m build bases",
                                description="The deb locks that pin bootstrapped bases by content.")
    sub = p.add_subparsers(dest="command", required=True)
    update = sub.add_parser("update", help="re-pin a base from its mirror's signed index (review the diff)")
    update.add_argument("base_dir", type=Path, help="e.g. images/_bases/debian-bookworm")
    export = sub.add_parser("export", help="copy every locked .deb into DIR, for a machine with no mirror")
    export.add_argument("directory", type=Path)
    imp = sub.add_parser("import", help="take the locked .debs from DIR into the cache, each re-hashed")
    imp.add_argument("directory", type=Path)
    for sp in (update, export, imp):
        add_common_options(sp)
    args = p.parse_args(argv)
    log = EventLog(json_lines=args.json_logs)
    if args.command == "update":
        problems = Problems()
        base = load_bootstrap_base(args.base_dir, problems)
        problems.raise_if_any(SpecErrors)
        try:
            old = debs_lock.load_lock(args.base_dir)
        except debs_lock.DebLockErrors:
            old = None     # a damaged lock is what `update` replaces
        lock = debs_lock.update_lock(base, log)
        path = debs_lock.write_lock(args.base_dir, lock)
        before = {d.package: d.version for d in old.debs} if old else {}
        changed = [f"{d.package} {before.get(d.package, '(new)')} -> {d.version}" for d in lock.debs
                   if before.get(d.package) != d.version]
        print(f"wrote {path}: {len(lock.debs)} packages, {len(changed)} changed; review and commit it")
        for line in changed[:200]:
            print(f"  {line}")
        return EXIT_OK
    locks = [lock for base_dir in sorted((REPO_ROOT / "images" / "_bases").iterdir())
             if (lock := debs_lock.load_lock(base_dir)) is not None]
    cache = open_cache(args.cache, force=args.force)
    if args.command == "export":
        count = debs_lock.export_debs(locks, cache, args.directory, log)
        print(f"exported {count} .deb files of {len(locks)} base lock(s) to {args.directory}")
    else:
        count = debs_lock.import_debs(locks, cache, args.directory)
        print(f"imported {count} .deb files, each matching its lock's sha256")
    return EXIT_OK


def bootstrap_base(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m build bootstrap-base",
                                description="Build a base image locally with debootstrap, written as an image "
                                            "archive and loaded (idempotent: one of the same spec hash is reused).")
    p.add_argument("base_dir", type=Path, help="e.g. images/_bases/debian-bookworm")
    add_common_options(p)
    args = p.parse_args(argv)
    problems = Problems()
    base = load_bootstrap_base(args.base_dir, problems)
    problems.raise_if_any(SpecErrors)
    result = bootstrap(base, connect(), open_cache(args.cache, force=args.force), EventLog(json_lines=args.json_logs))
    print(json.dumps({"ref": result.ref, "id": result.id, "reused": result.reused}))
    return EXIT_OK
