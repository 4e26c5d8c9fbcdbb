"""`python -m build IMAGE_DIR --plan [--json]`: the resolved plan, each kernel's cache state and
expected compile cost, and each layer's key and state. Nothing is built or written; of a registry
kernel entry only its manifest, signature and meta.json are read (checked as a build checks
them before downloading the wheel), so a kernel is `in registry, not yet checked`, never
`hit registry`."""
from __future__ import annotations

import json

from build.cli.common import EXIT_OK, open_cache, open_remote
from build.cli.plan_layers import engine_for_plan, layer_rows, render_rows
from build.cli.plan_sources import render_sources, source_rows
from build.cli.plan_view import render_plan
from build.kernels import expected_costs
from build.remote_cache.options import RemoteCacheOptions
from build.resolve import BuildPlan
from contracts.events import EventLog


def show_plan(plan: BuildPlan, *, cache_root, remote_options: RemoteCacheOptions | None, log: EventLog,
              as_json: bool) -> int:
    cache = open_cache(cache_root, write=False)
    remote = open_remote(remote_options, log)
    costs = expected_costs(plan, cache, remote.kernel_state if remote else None)
    engine, no_engine = engine_for_plan()     # read only: the runtime base's layers, if it is there
    layers = layer_rows(plan, cache, engine=engine, engine_problem=no_engine,
                        remote_state=remote.layer_state if remote else None,
                        registry_base=registry_base_diff_ids(plan, remote))
    sources = source_rows(plan, cache, engine=engine, remote=remote, costs=costs, layers=layers)
    if as_json:
        data = json.loads(plan.to_json())
        for kernel in data.get("kernels", []):   # what the table shows: cache state and compile cost
            state, cost = costs.get(kernel.get("key"), ("unknown", "unknown"))
            kernel["cache"] = {"state": state.split(":")[0].split(" (")[0].lower(), "detail": state,
                               "expected_compile": cost}
        data["layers"] = layers
        data["sources"] = sources
        if remote_options is not None:
            data["remote_cache"] = remote_options.describe()
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(render_plan(plan, costs))
        print(f"\n{render_rows(layers)}")
        print(f"\n{render_sources(sources)}")
        if remote_options is not None:
            print(f"remote cache {remote_options.describe()}")
    return EXIT_OK


def registry_base_diff_ids(plan: BuildPlan, remote) -> list[str] | None:
    """The runtime base's diffIDs from its registry entry's base.json (a few KiB, checked as a
    build checks it), for a runner whose engine does not hold the base: its layer keys follow."""
    if remote is None or plan.spec.runtime_base.bootstrap is None:
        return None
    from build.base.provide import expected_base

    found = remote.fetch_base(expected_base(plan.spec.runtime_base))
    return list(found.meta.config_document["rootfs"]["diff_ids"]) if found is not None else None
