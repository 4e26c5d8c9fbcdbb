"""Fused vs fallback kernels and packed vs padded batches on a GPU, side by side in one run.

    python bench/gpu_bench.py [--steps 4] [--warmup 2] [--budget 8192] [--json-out FILE]
    python bench/gpu_bench.py --dry-run          # CPU, tiny model: the control flow only

Two worker processes train the family's `bench` flavour (real per-layer shapes: attention
head dim 256, 16 key / 32 value GDN heads of 128, conv width 4; few layers, smaller vocab)
in bf16 on the same ultrachat-shaped batches (bench/packing.py's length model):
  fused     the installed kernels (flash-attn varlen, causal-conv1d, fla)
  fallback  fla and causal_conv1d made unimportable before transformers is imported, so it
            resolves its torch reference functions exactly as in a broken image; attention on sdpa
each with 1D packed rows (BFD, cu_seqlens/seq_idx) and 2D padded batches, warm-up steps
excluded. Per run: GPU kernel launches per step (torch.profiler), tokens/s, step time,
peak memory, MFU with attention FLOPs counted per document (sum of L_i^2, as the
entrypoint's metrics do). The fallback's packed run leaks across documents (it drops
seq_idx/cu_seqlens); it is timed only to separate the kernels' effect from packing's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fallback import hide_fused_packages  # noqa: E402

SCHEMES = ("packed", "padded")


def batches(scheme: str, budget: int, n_docs: int, steps: int, vocab: int, seed: int):
    """The first `steps` micro-batches of a shuffled ultrachat-shaped corpus, as training builds them."""
    import numpy as np

    from bench.packing import synthetic_ultrachat
    from entrypoint.batches import build_micro_batch
    from entrypoint.data import BadRows, Corpus
    from entrypoint.packing import pack_windows

    lengths = np.minimum(synthetic_ultrachat(n_docs, chars_per_token=4.0, sigma=0.55, seed=seed), budget)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, int(lengths.sum()), dtype=np.int32)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    corpus = Corpus.from_arrays(tokens, tokens.copy(), offsets, np.arange(len(lengths)), BadRows(), len(lengths))
    order = rng.permutation(len(lengths))
    bins = pack_windows(lengths, order, "bfd" if scheme == "packed" else "padded", budget,
                        len(lengths), np.random.default_rng(seed))
    return [build_micro_batch(corpus, b, packed=scheme == "packed", budget=budget, pad_token_id=0)
            for b in bins[:steps]]


def run_worker(args) -> dict:
    fallback = args.worker == "fallback"
    if fallback:
        hide_fused_packages()
    import torch

    from entrypoint.loss import loss_sum
    from entrypoint.metrics import device_peak_flops, flop_model
    from families import DEFAULT_FAMILY, load_family
    from families.runtime import build_model
    from verify.kernel_profile import cuda_kernel_names

    device = "cpu" if args.dry_run else "cuda"
    family = load_family(DEFAULT_FAMILY)
    flavour = "tiny" if args.dry_run else "bench"
    attn = "sdpa" if (fallback or args.dry_run) else family.attention.implementation
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    model = build_model(family, flavour, attn_implementation=attn, device=device,
                        dtype=torch.float32 if args.dry_run else torch.bfloat16, **overrides).train()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    flops = flop_model(model, model.config)
    peak = None if args.dry_run else device_peak_flops(0.0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {"mode": args.worker, "attn_implementation": attn, "device": torch.cuda.get_device_name(0)
           if device == "cuda" else "cpu", "torch": torch.__version__,
           "params": sum(p.numel() for p in model.parameters()), "runs": {}}

    def step(mb) -> None:
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.inputs.items()}
        loss = loss_sum(model, inputs, mb.labels.to(device), 4096) / max(mb.n_loss, 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for scheme in SCHEMES:
        mbs = batches(scheme, args.budget, args.docs, args.warmup + args.steps, model.config.vocab_size, args.seed)
        for mb in mbs[:args.warmup]:   # warm-up: Triton JIT, autotuning, allocator growth
            step(mb)
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timed = mbs[args.warmup:]
        started = time.perf_counter()
        for mb in timed:
            step(mb)
        sync()
        seconds = time.perf_counter() - started
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            step(timed[0])
            sync()
        launches = len(cuda_kernel_names(prof))
        real = sum(mb.n_real for mb in timed)
        sum_sq = sum(sum(n * n for n in mb.doc_lengths) for mb in timed)
        train_flops = flops.train_flops(real, sum_sq)
        out["runs"][scheme] = {
            "steps": len(timed), "real_tokens": real, "area": sum(mb.area for mb in timed),
            "step_s": seconds / len(timed), "tokens_per_s": real / seconds,
            "launches_per_step": launches,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None,
            "tflops": train_flops / seconds / 1e12, "mfu": train_flops / seconds / peak if peak else None,
        }
        print(f"[bench {args.worker}] {scheme}: {out['runs'][scheme]}", file=sys.stderr, flush=True)
    return out


def batches_per_epoch(budget: int, seed: int) -> dict:
    """Batch counts for a whole ultrachat-shaped epoch (what packing saves, independent of speed)."""
    import numpy as np

    from bench.packing import ULTRACHAT_TRAIN_SFT_ROWS, synthetic_ultrachat
    from entrypoint.packing import pack_windows

    lengths = np.minimum(synthetic_ultrachat(ULTRACHAT_TRAIN_SFT_ROWS, 4.0, 0.55, seed), budget)
    order = np.random.default_rng(seed).permutation(len(lengths))
    padded = len(pack_windows(lengths, order, "padded", budget, len(lengths)))
    packed = len(pack_windows(lengths, order, "bfd", budget, 10000))
    return {"padded": padded, "packed": packed, "packed_vs_padded": packed / padded}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarise(results: dict) -> dict:
    fused, fb = results.get("fused", {}).get("runs", {}), results.get("fallback", {}).get("runs", {})
    get = lambda runs, scheme, key: runs.get(scheme, {}).get(key)  # noqa: E731
    return {
        "launches_fallback_over_fused (padded)": ratio(get(fb, "padded", "launches_per_step"),
                                                       get(fused, "padded", "launches_per_step")),
        "launches_fallback_over_fused (packed)": ratio(get(fb, "packed", "launches_per_step"),
                                                       get(fused, "packed", "launches_per_step")),
        "tok_s_fused_over_fallback (padded)": ratio(get(fused, "padded", "tokens_per_s"),
                                                    get(fb, "padded", "tokens_per_s")),
        "tok_s_fused_over_fallback (packed)": ratio(get(fused, "packed", "tokens_per_s"),
                                                    get(fb, "packed", "tokens_per_s")),
        "tok_s_packed_over_padded (fused)": ratio(get(fused, "packed", "tokens_per_s"),
                                                  get(fused, "padded", "tokens_per_s")),
        "tok_s_fused_packed_over_fallback_padded": ratio(get(fused, "packed", "tokens_per_s"),
                                                         get(fb, "padded", "tokens_per_s")),
    }


TARGETS = {"launches_fallback_over_fused (padded)": 15.0, "tok_s_fused_over_fallback (padded)": 3.7,
           "tok_s_packed_over_padded (fused)": 1.5, "tok_s_fused_packed_over_fallback_padded": 6.0}


def render(results: dict) -> str:
    lines = [f"{'run':<18}{'launches/step':>14}{'tok/s':>12}{'step s':>9}{'peak GiB':>10}{'MFU':>8}"]
    for mode in ("fused", "fallback"):
        for scheme, r in results.get(mode, {}).get("runs", {}).items():
            mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
            lines.append(f"{mode + ' ' + scheme:<18}{r['launches_per_step']:>14}{r['tokens_per_s']:>12.0f}"
                         f"{r['step_s']:>9.3f}{mem:>10}{mfu:>8}")
    lines.append("")
    for name, value in results.get("ratios", {}).items():
        target = TARGETS.get(name)
        shown = f"{value:.2f}x" if value else "n/a"
        lines.append(f"{name:<45}{shown:>9}" + (f"   (target >= {target}x)" if target else ""))
    epoch = results.get("batches_per_epoch")
    if epoch:
        lines.append(f"{'batches per ultrachat epoch, packed/padded':<45}{epoch['packed_vs_padded']:>9.3f}"
                     f"   ({epoch['packed']} vs {epoch['padded']}; target <= 0.64)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (JIT, autotuning)")
    p.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--docs", type=int, default=4000, help="documents drawn to fill the batches")
    p.add_argument("--layers", type=int, default=0, help="override the flavour's layer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, help="write results here (after each worker, so a timeout keeps them)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, tiny budget: the control flow only")
    p.add_argument("--worker", choices=("fused", "fallback"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.budget, args.docs, args.steps, args.warmup = min(args.budget, 512), min(args.docs, 64), 1, 0
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; fix: run on a GPU host (or --dry-run for the control flow)",
              file=sys.stderr)
        return 2
    results: dict = {"budget": args.budget, "steps": args.steps, "warmup": args.warmup, "dry_run": args.dry_run}
    results["batches_per_epoch"] = batches_per_epoch(args.budget, args.seed) if not args.dry_run else None
    worker_args = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json-out" and not
                   (args.json_out and a == str(args.json_out))]
    for mode in ("fused", "fallback"):
        proc = subprocess.run([sys.executable, __file__, *worker_args, "--worker", mode], capture_output=True,
                              text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        sys.stderr.write(proc.stderr[-3000:])
        if proc.returncode != 0:
            results[mode] = {"error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
        else:
            results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        results["ratios"] = summarise(results)
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=2, default=_finite))
    print(render(results))
    return 0 if all("runs" in results.get(m, {}) for m in ("fused", "fallback")) else 1


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


if __name__ == "__main__":
    sys.exit(main())
