"""Fused vs fallback kernels and packed vs padded batches on a GPU, side by side in one run, fairly.

    python bench/gpu_bench.py [--flavour width27b --layers 4 8] [--budget 8192] [--json-out FILE]
    python bench/gpu_bench.py --dry-run          # CPU, tiny model: the control flow only

Worker processes train the same model (the family flavour, bf16, FSDP2 on one rank with full
activation checkpointing, fused AdamW: the trainer's own parallelize and step code) on the same
documents (a fixed ultrachat-shaped set, bench/packing_efficiency.py's length model):
  fused          the installed kernels (fla, causal-conv1d, flash-attn varlen)
  fallback       fla and causal_conv1d made unimportable before transformers is imported, so it
                 resolves its torch references as in a broken image; attention stays flash-attn
                 (the same attention family in every run: the comparison is the GDN kernels')
  fallback-loop  the same, with transformers <= 5.16's torch reference (its 63-step forward
                 substitution instead of solve_triangular), the baseline of the published result
Each with 1D packed rows (BFD, cu_seqlens/seq_idx) and 2D padded batches of the SAME documents.
Warm-up is one full pass over every timed batch (every shape is compiled and autotuned before
timing); the timed pass runs them again, timed with CUDA events (at least --min-steps steps).
GPU kernel launches are counted with CUDA-only profiling, kernels only (no memcpy/memset),
averaged over --profile-steps steps. With --layers 4 8 the per-layer launches (8-layer minus
4-layer, 3 gated-delta + 1 attention) are extrapolated to the 27B model's 64 layers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fallback import hide_fused_packages  # noqa: E402

SCHEMES = ("packed", "padded")
MODES = ("fused", "fallback", "fallback-loop")
FULL_LAYERS = 64            # the 27B model: 48 gated-delta + 16 attention
TARGETS = {"launches_fallback_over_fused": ("ge", 12.0), "step_time_fallback_over_fused": ("ge", 3.0),
           "time_packed_over_padded": ("le", 0.70), "fused_packed_over_fallback_padded": ("ge", 4.8)}


def documents(n_docs: int, budget: int, vocab: int, seed: int, chars_per_token: float = 4.0):
    """A fixed document set: token lengths from the ultrachat length model, random tokens, every
    token trained (the loss pattern does not change the kernels' work). A larger chars_per_token
    shortens every document alike (bench/family_bench.py scales them to a smaller budget)."""
    import numpy as np

    from bench.packing_efficiency import synthetic_ultrachat
    from entrypoint.data.corpus import BadRows, Corpus

    lengths = np.minimum(synthetic_ultrachat(n_docs, chars_per_token=chars_per_token, sigma=0.55, seed=seed), budget)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, int(lengths.sum()), dtype=np.int32)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Corpus.from_arrays(tokens, tokens.copy(), offsets, np.arange(len(lengths)), BadRows(), len(lengths))


def micro_batches(corpus, scheme: str, budget: int, seed: int):
    """Every micro-batch of the document set, as training builds them (one shuffled window)."""
    import numpy as np

    from entrypoint.data.micro_batches import build_micro_batch
    from entrypoint.data.packing import pack_windows

    order = np.random.default_rng(seed).permutation(len(corpus))
    bins = pack_windows(corpus.lengths, order, "bfd" if scheme == "packed" else "padded", budget, len(corpus),
                        np.random.default_rng(seed))
    return [build_micro_batch(corpus, b, packed=scheme == "packed", budget=budget, pad_token_id=0) for b in bins]


def kernel_launches(prof) -> int:
    """GPU kernels the profiler saw: kernel events only, memcpy and memset left out."""
    from torch.autograd import DeviceType

    count = 0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.name.lower()
        if name.startswith(("memcpy", "memset")) or "memcpy" in name or "memset" in name:
            continue
        count += 1
    return count


def run_worker(args) -> dict:
    if args.worker in ("fallback", "fallback-loop"):
        hide_fused_packages()
    import torch
    import torch.distributed as dist

    if args.worker == "fallback-loop":
        from transformers.models.qwen3_5 import modeling_qwen3_5

        # transformers <= 5.16's reference: the forward-substitution loop, kept behind this switch
        modeling_qwen3_5.is_torchdynamo_exporting = lambda: True

    from entrypoint.distributed import collectives
    from entrypoint.distributed.parallelize import apply_activation_checkpointing, apply_fsdp, build_mesh
    from entrypoint.observability.flops import device_peak_flops, flop_model
    from entrypoint.step import run_step
    from families import DEFAULT_FAMILY, load_family
    from families.runtime import build_model

    device = torch.device("cpu" if args.dry_run else "cuda", 0 if not args.dry_run else None)
    if not args.dry_run:
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(collectives.backend_for(device), rank=0, world_size=1)
    family = load_family(DEFAULT_FAMILY)
    flavour = "tiny" if args.dry_run else args.flavour
    attn = "sdpa" if args.dry_run else family.attention.implementation
    model = build_model(family, flavour, attn_implementation=attn, device="cpu", dtype=torch.float32,
                        num_hidden_layers=args.layer_count)
    model.config.use_cache = False
    flops = flop_model(model, model.config)
    n_params = sum(p.numel() for p in model.parameters())
    apply_activation_checkpointing(model, "full", 1)
    apply_fsdp(model, build_mesh(device.type, 1), param_dtype="float32" if args.dry_run else "bfloat16",
               reduce_dtype="float32")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0)
    peak = None if args.dry_run else device_peak_flops(0.0)
    corpus = documents(args.docs, args.budget, model.config.vocab_size, args.seed)
    out = {"mode": args.worker, "layers": args.layer_count, "attn_implementation": attn, "params": n_params,
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "documents": len(corpus), "tokens": corpus.n_tokens, "runs": {}}

    def step(mb) -> None:
        run_step(model, optimizer, scheduler, [mb], device=device, world=1, grad_clip=1.0, loss_chunk_tokens=4096,
                 stop=False, step=0, epoch=0, data_s=0.0)

    def timed(mbs: list) -> float:
        if device.type != "cuda":
            import time

            started = time.perf_counter()
            for mb in mbs:
                step(mb)
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for mb in mbs:
            step(mb)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    for scheme in SCHEMES:
        mbs = micro_batches(corpus, scheme, args.budget, args.seed)
        passes = max(1, -(-args.min_steps // len(mbs)))
        timed(mbs)                                     # warm-up: every timed shape, JIT and autotuning
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = timed(mbs * passes) / passes         # one pass over the documents
        from torch.profiler import ProfilerActivity, profile

        profiled = (mbs * args.profile_steps)[:args.profile_steps]
        activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for mb in profiled:
                step(mb)
            if device.type == "cuda":
                torch.cuda.synchronize()
        launches = kernel_launches(prof) / len(profiled) if device.type == "cuda" else None
        real = sum(mb.n_real for mb in mbs)
        train_flops = flops.train_flops(real, sum(sum(n * n for n in mb.doc_lengths) for mb in mbs))
        out["runs"][scheme] = {
            "steps": len(mbs), "timed_steps": len(mbs) * passes, "seconds_per_pass": seconds,
            "step_s": seconds / len(mbs), "tokens_per_s": real / seconds, "launches_per_step": launches,
            "profiled_steps": len(profiled),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None,
            "tflops": train_flops / seconds / 1e12, "mfu": train_flops / seconds / peak if peak else None,
        }
        print(f"[bench {args.worker} {args.layer_count}L] {scheme}: {out['runs'][scheme]}", file=sys.stderr,
              flush=True)
    dist.destroy_process_group()
    return out


def batches_per_epoch(budget: int, seed: int) -> dict:
    """Batch counts for a whole ultrachat-shaped epoch (what packing saves, independent of speed)."""
    import numpy as np

    from bench.packing_efficiency import ULTRACHAT_TRAIN_SFT_ROWS, synthetic_ultrachat
    from entrypoint.data.packing import pack_windows

    lengths = np.minimum(synthetic_ultrachat(ULTRACHAT_TRAIN_SFT_ROWS, 4.0, 0.55, seed), budget)
    order = np.random.default_rng(seed).permutation(len(lengths))
    padded = len(pack_windows(lengths, order, "padded", budget, len(lengths)))
    packed = len(pack_windows(lengths, order, "bfd", budget, 10000))
    return {"padded": padded, "packed": packed, "packed_vs_padded": packed / padded}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def extrapolate(small: float | None, large: float | None, small_layers: int, large_layers: int) -> float | None:
    """Launches at FULL_LAYERS from two layer counts: the rest of the step plus per-layer cost."""
    if small is None or large is None or large_layers == small_layers:
        return None
    per_layer = (large - small) / (large_layers - small_layers)
    return small + per_layer * (FULL_LAYERS - small_layers)


def summarise(results: dict) -> dict:
    layers = sorted(results.get("layers", {}), key=int)
    get = lambda n, mode, scheme, key: results["layers"][n].get(mode, {}).get("runs", {}).get(scheme, {}).get(key)  # noqa: E731
    top = layers[-1] if layers else None
    out = {}
    for baseline in ("fallback", "fallback-loop"):
        if len(layers) >= 2:
            a, b = layers[0], layers[-1]
            fused64 = extrapolate(get(a, "fused", "padded", "launches_per_step"),
                                  get(b, "fused", "padded", "launches_per_step"), int(a), int(b))
            base64 = extrapolate(get(a, baseline, "padded", "launches_per_step"),
                                 get(b, baseline, "padded", "launches_per_step"), int(a), int(b))
            out[f"launches_64_layers ({baseline}, fused)"] = [base64, fused64]
            out[f"launches_fallback_over_fused ({baseline})"] = ratio(base64, fused64)
        elif top:
            out[f"launches_fallback_over_fused ({baseline})"] = ratio(get(top, baseline, "padded", "launches_per_step"),
                                                                     get(top, "fused", "padded", "launches_per_step"))
        if top:
            out[f"step_time_fallback_over_fused ({baseline})"] = ratio(get(top, baseline, "padded", "step_s"),
                                                                      get(top, "fused", "padded", "step_s"))
            out[f"fused_packed_over_fallback_padded ({baseline})"] = ratio(
                get(top, baseline, "padded", "seconds_per_pass"), get(top, "fused", "packed", "seconds_per_pass"))
    if top:
        out["time_packed_over_padded"] = ratio(get(top, "fused", "packed", "seconds_per_pass"),
                                               get(top, "fused", "padded", "seconds_per_pass"))
        out["mfu_fused_packed"] = get(top, "fused", "packed", "mfu")
    return out


def verdict(name: str, value: float | None) -> str:
    key = name.split(" (")[0]
    if key not in TARGETS or value is None:
        return ""
    op, target = TARGETS[key]
    ok = value >= target if op == "ge" else value <= target
    return f"   (target {'>=' if op == 'ge' else '<='} {target}x: {'PASS' if ok else 'FAIL'})"


def render(results: dict) -> str:
    lines = [f"{'run':<26}{'launches/step':>14}{'tok/s':>12}{'step s':>9}{'pass s':>9}{'peak GiB':>10}{'MFU':>8}"]
    for layers, modes in sorted(results.get("layers", {}).items(), key=lambda kv: int(kv[0])):
        for mode in MODES:
            for scheme, r in modes.get(mode, {}).get("runs", {}).items():
                mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
                mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
                launches = f"{r['launches_per_step']:.0f}" if r.get("launches_per_step") is not None else "-"
                lines.append(f"{f'{layers}L {mode} {scheme}':<26}{launches:>14}{r['tokens_per_s']:>12.0f}"
                             f"{r['step_s']:>9.3f}{r['seconds_per_pass']:>9.2f}{mem:>10}{mfu:>8}")
            if "error" in modes.get(mode, {}):
                lines.append(f"{f'{layers}L {mode}':<26} FAILED: {modes[mode]['error']}")
    lines.append("")
    for name, value in results.get("ratios", {}).items():
        if isinstance(value, list):
            shown = " / ".join(f"{v:,.0f}" if v else "n/a" for v in value)
            lines.append(f"{name:<58}{shown:>20}")
            continue
        shown = f"{value:.3f}" if isinstance(value, float) else "n/a"
        lines.append(f"{name:<58}{shown:>20}{verdict(name, value)}")
    epoch = results.get("batches_per_epoch")
    if epoch:
        lines.append(f"{'batches per ultrachat epoch, packed/padded':<58}{epoch['packed_vs_padded']:>20.3f}"
                     f"   ({epoch['packed']} vs {epoch['padded']}; target <= 0.64)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavour", default="width27b", help="family flavour (width27b: the 27B per-layer widths)")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8], help="layer counts to run (extrapolated to 64)")
    p.add_argument("--min-steps", type=int, default=8, help="timed steps at least (passes over the documents)")
    p.add_argument("--profile-steps", type=int, default=4, help="steps the launch count is averaged over")
    p.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--docs", type=int, default=48, help="documents in the fixed set every run trains on")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="write results here (after each worker, so a timeout keeps them)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, tiny budget: the control flow only")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--layer-count", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.budget, args.docs, args.min_steps, args.profile_steps = min(args.budget, 512), min(args.docs, 12), 2, 1
        args.layers = [2, 4]
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; fix: run on a GPU host (or --dry-run for the control flow)",
              file=sys.stderr)
        return 2
    results: dict = json.loads(args.json_out.read_text()) if args.json_out and args.json_out.is_file() else {}
    results.update({"budget": args.budget, "docs": args.docs, "min_steps": args.min_steps,
                    "profile_steps": args.profile_steps, "flavour": args.flavour, "dry_run": args.dry_run})
    results["batches_per_epoch"] = batches_per_epoch(args.budget, args.seed) if not args.dry_run else None
    results.setdefault("layers", {})
    forwarded = ["--flavour", args.flavour, "--min-steps", str(args.min_steps), "--profile-steps",
                 str(args.profile_steps), "--budget", str(args.budget), "--docs", str(args.docs), "--seed",
                 str(args.seed), *(["--dry-run"] if args.dry_run else [])]
    for layers in args.layers:
        done = results["layers"].setdefault(str(layers), {})
        for mode in args.modes:
            if "runs" in done.get(mode, {}):
                continue   # measured by an earlier, interrupted run of the kit
            proc = subprocess.run([sys.executable, __file__, *forwarded, "--worker", mode, "--layer-count",
                                   str(layers)], capture_output=True, text=True,
                                  env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            sys.stderr.write(proc.stderr[-3000:])
            if proc.returncode != 0:
                done[mode] = {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
            else:
                done[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
            results["ratios"] = summarise(results)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=2, default=_finite))
    results["ratios"] = summarise(results)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2, default=_finite))
    print(render(results))
    return 0 if all("runs" in m for modes in results["layers"].values() for m in modes.values()) else 1


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


if __name__ == "__main__":
    sys.exit(main())
