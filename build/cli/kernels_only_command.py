"""`python -m build IMAGE_DIR --kernels-only [--json]`: compile (or find in the caches) and check
the plan's kernels, shared through the remote cache when one is named; no image is built."""
from __future__ import annotations

import json

from build.base.bootstrap import ensure_base
from build.cache import CacheLayout
from build.cli.common import EXIT_OK
from build.engine import connect
from build.kernels import provide_kernels
from build.remote_cache import RemoteCache
from build.resolve import BuildPlan
from contracts.events import EventLog
from contracts.table import render_table


def kernels_only(plan: BuildPlan, cache: CacheLayout, log: EventLog, *, as_json: bool,
                 remote: RemoteCache | None = None) -> int:
    engine = connect()
    # the builder base is bootstrapped only when a kernel has to be compiled (not on cache hits)
    provided = provide_kernels(plan, cache=cache, engine=engine, log=log,
                               builder_base=lambda: ensure_base(plan.spec.builder_base, engine, cache, log).ref,
                               remote=remote.fetch_kernel if remote else None)
    if remote is not None:
        for entry in provided.entries.values():
            remote.queue_kernel(entry)
        remote.flush()
    rows = [{"kernel": w.name, "key": w.key, "wheel": w.filename, "sha256": w.sha256, "archs": list(w.archs),
             "cache": provided.states[w.name]} for w in provided.wheels]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_table([[r["kernel"], r["key"][:16], r["wheel"], ",".join(r["archs"]) or "-", r["cache"]]
                            for r in rows], ["KERNEL", "KEY", "WHEEL", "SASS", "CACHE"]))
    return EXIT_OK
