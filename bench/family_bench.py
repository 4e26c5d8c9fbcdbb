"""Fused vs fallback and packed vs padded for every model family, side by side in one run.

    python bench/family_bench.py [--families a,b] [--json-out FILE]      # GPU: each family's `bench` flavour, bf16
    python bench/family_bench.py --device cpu --flavour tiny [--families a,b] [--json-out FILE]   # CPU smoke

Why a second benchmark beside bench/gpu_bench.py: that one answers for one family (Qwen3.5 at the
27B widths, extrapolated from two layer counts to 64, against its published targets). This one
asks the same two questions of every family in families/, at each family's own per-layer widths
(its `bench` flavour: real widths, few layers), so a family added to families/ is measured with
no new code: what do the image's kernels save over transformers' torch reference, and what does
packing save over padding.

For each family, worker processes train the flavour with the trainer's own code (FSDP2 on one
rank, full activation checkpointing, the family's FSDP units and batch kwargs, run_step) on the
same fixed documents (gpu_bench.documents, the ultrachat length model, scaled to the budget):
  fused     the installed kernels
  fallback  the kernel packages made unimportable before transformers is imported
            (bench/fallback.py), so transformers binds its torch references as in a broken image;
            attention is the same in both (the family's, or sdpa with --attention sdpa)
each with 1D packed rows and 2D padded batches of the SAME documents. Per run, over profiled
training steps (forward, backward and optimizer step):
  aten ops     every aten op the profiler saw, counted as the trainer's `output.profile_steps`
               counts them (entrypoint/observability/profiling.py)
  ops          the same without what ran inside a kernel call, plus one op per kernel call and
               one per kernel backward: a kernel is one op to the torch path whatever it does
               inside (a real kernel's inside is GPU launches, not aten ops; a CPU double's inside
               is torch code, which would otherwise count). The fused/fallback op ratio uses this
  launches     GPU kernel launches (CUDA only, gpu_bench.kernel_launches)
and the median step time after one warm-up pass over every batch (every shape compiled and
autotuned first), and the time of one pass over the documents. Ratios are taken only between
runs of this one invocation. What transformers bound for each of the family's fused functions is
recorded, so a "fused" run that silently fell back shows as such (and counts no kernel calls).

CPU smoke (--device cpu --flavour tiny): the test doubles in tests/guard/kernels/fused stand in
for the kernels (first on sys.path; the fallback run hides them as it hides real kernels). The
doubles are torch code, not kernels: CPU times mean nothing. Op counts are device-independent
counts of the torch path each mode took.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gpu_bench import _finite, documents, kernel_launches, micro_batches, ratio  # noqa: E402

MODES = ("fused", "fallback")
SCHEMES = ("packed", "padded")
DOUBLES = REPO / "tests" / "guard" / "kernels" / "fused"
FULL_BUDGET = 8192     # the token budget the ultrachat length model is scaled against
CPU_NOTE = ("CPU SMOKE: 'fused' runs the CPU test doubles of the kernels (tests/guard/kernels/fused), which are "
            "torch code, not kernels; times on CPU mean nothing. ops/step counts each kernel call as one op (what a "
            "double does inside is left out); aten ops/step counts everything, the doubles' torch code included.")


KERNEL_MARK = "kernel::"
BACKWARD_EVENT = "autograd::engine::evaluate_function: "


def _kernel_nodes(out, depth: int = 3) -> set[str]:
    """Names of the custom autograd Functions (a kernel's backward) behind a kernel call's output:
    its grad_fn, or one a few C++ nodes (a cast, a view) above it."""
    from torch.autograd.function import BackwardCFunction

    first = out[0] if isinstance(out, (tuple, list)) and out else out
    todo, found = [(getattr(first, "grad_fn", None), 0)], set()
    while todo:
        node, level = todo.pop()
        if node is None or level > depth:
            continue
        if isinstance(node, BackwardCFunction):
            found.add(node.name())
            continue
        todo += [(n, level + 1) for n, _ in node.next_functions]
    return found


def mark_kernel_calls(family, backward_nodes: set[str]) -> None:
    """Wrap each of the family's fused functions that transformers bound to a kernel, so the
    profiler sees its call as one event (and learns the name of its backward node). The modeling
    code looks these names up at call time; a torch reference is never wrapped."""
    import torch

    from families import runtime
    from families.binding import read_resolution

    module = runtime.modeling_module(family)
    for fused in family.fused_functions:
        original = getattr(module, fused.wrapper, None)
        if original is None or getattr(original, "_family_bench_mark", False) \
                or not read_resolution(module, fused.wrapper).is_new:
            continue

        @functools.wraps(original)
        def marked(*args, _original=original, _name=fused.function, **kwargs):
            with torch.profiler.record_function(KERNEL_MARK + _name):
                out = _original(*args, **kwargs)
            backward_nodes.update(_kernel_nodes(out))
            return out

        marked._family_bench_mark = True
        setattr(module, fused.wrapper, marked)


def op_counts(prof, backward_nodes: set[str]) -> dict:
    """aten ops in all (the trainer's count, entrypoint/observability/profiling.py: the aten:: rows
    of key_averages() summed, one per aten event, read here from the events themselves); those
    inside kernel calls (forward and backward); kernel calls."""
    def is_kernel(event) -> bool:
        name = event.name
        return name.startswith(KERNEL_MARK) or (name.startswith(BACKWARD_EVENT)
                                                and name[len(BACKWARD_EVENT):] in backward_nodes)

    total = inside = calls = 0
    for event in prof.events():
        if is_kernel(event):
            calls += 1
        elif event.name.startswith("aten::"):
            total += 1
            parent = event.cpu_parent
            while parent is not None and not is_kernel(parent):
                parent = parent.cpu_parent
            inside += parent is not None
    return {"aten": total, "inside_kernels": inside, "kernel_calls": calls, "ops": total - inside + calls}


def bindings(family) -> dict:
    """function -> what transformers bound for it (the kernel's function or its torch reference)."""
    from families import runtime
    from families.binding import describe, read_resolution

    module = runtime.modeling_module(family)
    out = {}
    for fused in family.fused_functions:
        res = read_resolution(module, fused.wrapper)
        out[fused.function] = {"kernel": res.is_new, "bound": describe(res.implementation) if res.readable
                               else res.error}
    return out


def bench_family(name: str, args, device) -> dict:
    import torch

    from entrypoint.distributed.parallelize import apply_activation_checkpointing, apply_fsdp, build_mesh
    from entrypoint.step import run_step
    from families import load_family
    from families.runtime import add_batch_kwargs, build_model

    family = load_family(name)
    cuda = device.type == "cuda"
    attn = family.attention.implementation if cuda and args.attention == "family" else "sdpa"
    if cuda:
        with torch.device(device):     # built on the GPU: the bench widths take minutes to initialise on a CPU
            model = build_model(family, args.flavour, attn_implementation=attn, device=device.type,
                                dtype=torch.float32, seed=args.seed)
    else:
        model = build_model(family, args.flavour, attn_implementation=attn, dtype=torch.float32, seed=args.seed)
    model.config.use_cache = False
    out = {"family": name, "flavour": args.flavour, "attn_implementation": attn,
           "layers": model.config.num_hidden_layers, "params": sum(p.numel() for p in model.parameters()),
           "experts_implementation": getattr(model.config, "_experts_implementation", None) if family.experts
           else None, "bindings": bindings(family), "runs": {}}
    backward_nodes: set[str] = set()
    mark_kernel_calls(family, backward_nodes)
    apply_activation_checkpointing(model, "full", 1, family_name=name)
    apply_fsdp(model, build_mesh(device.type, 1), param_dtype="bfloat16" if cuda else "float32",
               reduce_dtype="float32", family_name=name)
    add_batch_kwargs(family, model)
    model.to(device)
    chosen = args.optimizer
    if chosen == "auto":   # fp32 weights, gradients and two moments: 16 B a parameter
        room = torch.cuda.get_device_properties(device).total_memory if cuda else float("inf")
        chosen = "adamw" if 16 * out["params"] <= 0.6 * room else "sgd"
    out["optimizer"] = chosen
    if chosen == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    else:   # no state: the same in both modes, so the fused/fallback comparison is unchanged
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0)
    corpus = documents(args.docs, args.budget, model.config.vocab_size, args.seed,
                       chars_per_token=4.0 * FULL_BUDGET / args.budget)

    def step(mb) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        run_step(model, optimizer, scheduler, [mb], device=device, world=1, grad_clip=1.0, loss_chunk_tokens=4096,
                 stop=False, step=0, epoch=0, data_s=0.0)
        if not cuda:
            return time.perf_counter() - started
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    from torch.profiler import ProfilerActivity, profile

    for scheme in SCHEMES:
        mbs = micro_batches(corpus, scheme, args.budget, args.seed)
        for mb in mbs if cuda else []:      # warm-up: every shape compiled and autotuned (CPU times mean nothing)
            step(mb)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        passes = max(1, -(-args.min_steps // len(mbs)))
        times = [step(mb) for mb in mbs * passes]
        profiled = (mbs * args.profile_steps)[:args.profile_steps]
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            for mb in profiled:
                step(mb)
        real = sum(mb.n_real for mb in mbs)
        ops = {f"{k}_per_step": v / len(profiled) for k, v in op_counts(prof, backward_nodes).items()}
        out["runs"][scheme] = {
            "steps": len(mbs), "timed_steps": len(times), "median_step_s": statistics.median(times),
            "pass_s": sum(times) / passes, "tokens_per_s": real * passes / sum(times),
            "ops_per_step": ops["ops_per_step"], "aten_ops_per_step": ops["aten_per_step"],
            "aten_ops_inside_kernels_per_step": ops["inside_kernels_per_step"],
            "kernel_calls_per_step": ops["kernel_calls_per_step"], "profiled_steps": len(profiled),
            "launches_per_step": kernel_launches(prof) / len(profiled) if cuda else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
        }
        print(f"[family_bench {args.worker} {name}] {scheme}: {out['runs'][scheme]}", file=sys.stderr, flush=True)
    return out


def run_worker(args) -> dict:
    if args.device == "cpu":
        sys.path.insert(0, str(DOUBLES))    # both modes: the fallback run hides them as it hides real kernels
    if args.worker == "fallback":
        from bench.fallback import hide_fused_packages

        hide_fused_packages()
    import torch
    import torch.distributed as dist

    from entrypoint.distributed import collectives

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(collectives.backend_for(device), rank=0, world_size=1)
    out = {"mode": args.worker, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "families": {}}
    for name in args.families.split(","):
        try:
            out["families"][name] = bench_family(name, args, device)
        except Exception as exc:  # noqa: BLE001 - one family's failure is its row, not the run's end
            out["families"][name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            print(f"[family_bench {args.worker} {name}] FAILED: {out['families'][name]['error']}", file=sys.stderr,
                  flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return out


def summarise(fam: dict) -> dict:
    """The side-by-side ratios of one family, from the runs of this invocation only."""
    get = lambda mode, scheme, key: fam.get(mode, {}).get("runs", {}).get(scheme, {}).get(key)  # noqa: E731
    out = {"ops_per_step": {m: {s: get(m, s, "ops_per_step") for s in SCHEMES} for m in MODES}}
    for scheme in SCHEMES:
        out[f"ops_fallback_over_fused ({scheme})"] = ratio(get("fallback", scheme, "ops_per_step"),
                                                           get("fused", scheme, "ops_per_step"))
        out[f"aten_ops_fallback_over_fused ({scheme})"] = ratio(get("fallback", scheme, "aten_ops_per_step"),
                                                                get("fused", scheme, "aten_ops_per_step"))
        out[f"launches_fallback_over_fused ({scheme})"] = ratio(get("fallback", scheme, "launches_per_step"),
                                                                get("fused", scheme, "launches_per_step"))
        out[f"step_time_fallback_over_fused ({scheme})"] = ratio(get("fallback", scheme, "median_step_s"),
                                                                 get("fused", scheme, "median_step_s"))
    for mode in MODES:
        out[f"pass_time_packed_over_padded ({mode})"] = ratio(get(mode, "packed", "pass_s"),
                                                              get(mode, "padded", "pass_s"))
    out["fused_packed_speedup_over_fallback_padded"] = ratio(get("fallback", "padded", "pass_s"),
                                                             get("fused", "packed", "pass_s"))
    bound = fam.get("fused", {}).get("bindings", {})
    out["fused_bound"] = f"{sum(b['kernel'] for b in bound.values())}/{len(bound)}" if bound else None
    return out


def render(results: dict) -> str:
    lines = [CPU_NOTE, ""] if results.get("device") == "cpu" else []
    for name, fam in results.get("families", {}).items():
        first = next((fam[m] for m in MODES if "runs" in fam.get(m, {})), {})
        params = f"{first['params'] / 1e6:,.1f}M params" if first else "not built"
        lines.append(f"== {name}: {results.get('flavour')} flavour, {first.get('layers', '?')} layers, {params}, "
                     f"attention {first.get('attn_implementation', '?')}, optimizer {first.get('optimizer', '?')}, "
                     f"on {first.get('device') or results.get('device')}")
        lines.append(f"{'run':<18}{'ops/step':>10}{'kernel calls':>14}{'aten ops/step':>15}{'launches/step':>15}"
                     f"{'median step s':>15}{'pass s':>10}{'tok/s':>11}{'peak GiB':>10}")
        for mode in MODES:
            if "error" in fam.get(mode, {}):
                lines.append(f"{mode:<18} FAILED: {fam[mode]['error']}")
            for scheme, r in fam.get(mode, {}).get("runs", {}).items():
                launches = f"{r['launches_per_step']:.0f}" if r.get("launches_per_step") is not None else "-"
                mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
                lines.append(f"{f'{mode} {scheme}':<18}{r['ops_per_step']:>10.0f}{r['kernel_calls_per_step']:>14.0f}"
                             f"{r['aten_ops_per_step']:>15.0f}{launches:>15}"
                             f"{r['median_step_s']:>15.4f}{r['pass_s']:>10.3f}{r['tokens_per_s']:>11.0f}{mem:>10}")
        ratios = fam.get("ratios", {})
        for key, value in ratios.items():
            if isinstance(value, float):
                lines.append(f"  {key:<52}{value:>10.3f}")
        if ratios.get("fused_bound"):
            lines.append(f"  {'fused functions bound to a kernel in the fused run':<52}{ratios['fused_bound']:>10}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from families import known_families

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(known_families()), help="comma-separated (default: all)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--flavour", default="bench", help="family flavour (bench: real per-layer widths, few layers)")
    p.add_argument("--attention", choices=("family", "sdpa"), default="family",
                   help="the family's attention (flash-attn) or sdpa, in both modes (CPU: always sdpa)")
    p.add_argument("--optimizer", choices=("auto", "adamw", "sgd"), default="auto",
                   help="adamw as the trainer (fused on CUDA); sgd keeps no state; auto: adamw where fp32 "
                        "weights, gradients and moments take at most 60%% of the GPU, else sgd")
    p.add_argument("--min-steps", type=int, default=8, help="timed steps at least (passes over the documents)")
    p.add_argument("--profile-steps", type=int, default=2, help="steps the op counts are averaged over")
    p.add_argument("--budget", type=int, default=FULL_BUDGET, help="tokens per micro-batch")
    p.add_argument("--docs", type=int, default=32, help="documents in the fixed set every run trains on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="write results here (after each worker, so a timeout keeps them)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    unknown = sorted(set(names) - set(known_families()))
    if unknown or not names:
        print(f"family_bench: unknown families {unknown or '(none given)'}; fix: choose from "
              f"{','.join(known_families())}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        args.budget, args.docs = min(args.budget, 256), min(args.docs, 8)
        args.min_steps, args.profile_steps = min(args.min_steps, 2), 1
    if args.worker:
        print(json.dumps(run_worker(args), default=_finite))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("family_bench: no CUDA device; fix: run on a GPU host (or --device cpu --flavour tiny for the "
                  "smoke run)", file=sys.stderr)
            return 2
    results = {"device": args.device, "flavour": args.flavour, "budget": args.budget, "docs": args.docs,
               "min_steps": args.min_steps, "profile_steps": args.profile_steps, "optimizer": args.optimizer,
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "doubles": args.device == "cpu",
               **({"note": CPU_NOTE} if args.device == "cpu" else {}), "families": {n: {} for n in names}}
    forwarded = ["--device", args.device, "--flavour", args.flavour, "--attention", args.attention, "--optimizer",
                 args.optimizer, "--min-steps", str(args.min_steps), "--profile-steps", str(args.profile_steps),
                 "--budget", str(args.budget), "--docs", str(args.docs), "--seed", str(args.seed)]
    # one process per family and mode on a GPU (an OOM or a hang stays that family's); on a CPU one per
    # mode, since importing torch and transformers is most of a smoke run
    groups = [[n] for n in names] if args.device == "cuda" else [names]
    for group in groups:
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, *forwarded, "--families", ",".join(group),
                                   "--worker", mode], capture_output=True, text=True,
                                  env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            sys.stderr.write(proc.stderr[-3000:])
            try:
                worker = json.loads(proc.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                error = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
                worker = {"families": {n: {"error": error} for n in group}}
            for name in group:
                results["families"][name][mode] = {**worker["families"][name], "device": worker.get("device"),
                                                   "torch": worker.get("torch")}
                results["families"][name]["ratios"] = summarise(results["families"][name])
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=2, default=_finite))
    print(render(results))
    complete = all("runs" in fam.get(m, {}) for fam in results["families"].values() for m in MODES)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
