"""What the trainer costs at size, measured with the project's own `finetune` on CPU (gloo ranks).

    python bench/scale.py memory [--worlds 2 4]   peak host RSS per rank: load, steps, export (0.8B hybrid)
    python bench/scale.py async  [--steps 8]      step time with an async checkpoint in flight vs without (0.3B)

memory: a 0.82B Qwen3.5 hybrid (20 layers, 15 gated-delta + 5 attention, head_dim 256) written as
bf16 safetensors, loaded and exported by gloo ranks with the trainer's own code (sharded_model,
hf_checkpoint.export), once per world size; each rank reports its peak RSS after each. Target per
rank: <= 1.2 x (params x 4 bytes / world) + 2 GiB. Then a whole run (load, 2 steps, checkpoint,
export) of a 0.29B hybrid on 2 ranks with `finetune` (the 0.8B model's Adam state would not fit
two ranks on a 24 GiB machine): rank 0 within 1.2x of the other rank (no rank gathers the model).

async: a 0.29B hybrid, checkpoint.every=2 with checkpoint.async=true vs false, the same steps;
reports the mean step time of steps that ran while a save was in flight against steps with none,
and each save's time and size. Target: <= 1.2x.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "0.8b": dict(hidden_size=1536, intermediate_size=4864, num_hidden_layers=20, full_attention_interval=4,
                 num_attention_heads=12, num_key_value_heads=2, head_dim=256, linear_num_key_heads=8,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=32000),
    "0.3b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, full_attention_interval=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=8,
                 linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000),
}


def make_model(root: Path, shape: str) -> tuple[Path, int]:
    import torch

    from families import load_family
    from families.runtime import build_model
    from tests.fixtures.chat import synthetic_conversations, write_tokenizer

    model_dir = root / f"model-{shape}"
    rows = synthetic_conversations(64, seed=0)
    write_tokenizer(model_dir, [m["content"] for r in rows for m in r["messages"]])
    model = build_model(load_family("qwen3_5_text"), "tiny", attn_implementation="sdpa", dtype=torch.bfloat16,
                        **SHAPES[shape])
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(model_dir))
    del model
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, n_params


def finetune(root: Path, model_dir: Path, out: Path, *overrides: str) -> dict:
    import yaml

    config = {"model": {"path": str(model_dir)}, "data": {"path": str(root / "data.jsonl"), "max_length": 512},
              "packing": {"budget": 512}, "train": {"warmup_steps": 1, "lr": 1e-5},
              "parallel": {"param_dtype": "float32"}, "output": {"log_every": 1}}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "FTIMAGE_LOCK": "/nonexistent", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-m", "entrypoint", "finetune", "--config", str(root / "config.yaml"),
                           "--allow-fallback", f"output.dir={out}", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"finetune failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"report": json.loads((out / "run_report.json").read_text()), "stdout": proc.stdout}


def _load_export_worker(rank: int, world: int, init: str, model_dir: str, out_dir: str, queue) -> None:
    """One rank of the load/export measurement: the trainer's own sharded load and export."""
    import resource

    import torch
    import torch.distributed as dist

    from contracts.finetune_config import build_config
    from entrypoint.checkpoint.hf_safetensors import export
    from entrypoint.model import load_tokenizer, sharded_model
    from entrypoint.observability.run_summary import AnonPeak

    anon = AnonPeak()

    def peak() -> dict:
        return {"anon": anon.peak / 2 ** 30, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    base = peak()
    cfg = build_config([{"model": {"path": model_dir}, "data": {"path": "unused"},
                         "parallel": {"param_dtype": "bfloat16"}}])
    model, _ = sharded_model(cfg, attn="sdpa", device=torch.device("cpu"), world=world)
    loaded = peak()
    export(model, model.config, load_tokenizer(model_dir), Path(model_dir), Path(out_dir), dtype=torch.bfloat16,
           rank=rank, barrier=dist.barrier)
    queue.put({"rank": rank, "base": base, "load": loaded, "export": peak()})
    queue.close()
    queue.join_thread()
    dist.barrier()
    os._exit(0)   # as the trainer does: a joinable gloo thread can abort a finished process at exit


def memory(args) -> int:
    import multiprocessing as mp

    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.tmp) as tmp:
        root = Path(tmp)
        model_dir, n_params = make_model(root, "0.8b")
        weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        print(f"model: {n_params / 1e9:.3f}B params, bf16 safetensors {weights / 2 ** 30:.2f} GiB")
        print("load and export (the trainer's own sharded_model and hf_checkpoint.export, gloo ranks on CPU):")
        ctx = mp.get_context("spawn")
        for world in args.worlds:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_load_export_worker, args=(r, world, f"file://{root}/pg-{world}",
                                                                   str(model_dir), str(root / f"export-{world}"),
                                                                   queue)) for r in range(world)]
            for p in procs:
                p.start()
            rows = sorted((queue.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
            for p in procs:
                p.join()
            bound = 1.2 * n_params * 4 / world / 2 ** 30 + 2
            for phase in ("load", "export"):
                peaks = [r[phase]["anon"] for r in rows]
                verdict = "PASS" if max(peaks) <= bound and peaks[0] <= 1.2 * max(peaks[1:]) else "FAIL"
                ok &= verdict == "PASS"
                print(f"  world {world} {phase:<6} peak private memory (RssAnon) " + ", ".join(
                    f"rank {r} {v:.2f}" for r, v in enumerate(peaks))
                      + f" GiB; bound {bound:.2f} GiB (1.2 x params x 4 B / {world} + 2 GiB); {verdict}; "
                      f"peak RSS with shared file pages {max(r[phase]['rss'] for r in rows):.2f} GiB")
            shutil.rmtree(root / f"export-{world}", ignore_errors=True)
        small, n_small = make_model(root, "0.3b")
        result = finetune(root, small, root / "run", "launch.nproc_per_node=2", "train.max_steps=2",
                          "checkpoint.every=0", "checkpoint.export_dtype=bfloat16")
        peaks = [p["anon"] for p in result["report"]["host_peak_gib"]["export"]]
        ratio = peaks[0] / max(peaks[1:])
        ok &= ratio <= 1.2
        print(f"whole run ({n_small / 1e9:.2f}B, 2 ranks, load + 2 steps + checkpoint + export): peak RssAnon "
              + ", ".join(f"rank {r} {v:.2f}" for r, v in enumerate(peaks))
              + f" GiB; rank 0 / other = {ratio:.2f}x (target <= 1.2x) {'PASS' if ratio <= 1.2 else 'FAIL'}")
    return 0 if ok else 1


def async_bench(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-async-", dir=args.tmp) as tmp:
        root = Path(tmp)
        model_dir, n_params = make_model(root, "0.3b")
        print(f"model: {n_params / 1e9:.3f}B params; {args.steps} steps, a checkpoint every 2; 2 ranks")
        times = {}
        for mode in ("false", "true"):
            out = root / f"out-{mode}"
            result = finetune(root, model_dir, out, "launch.nproc_per_node=2", f"train.max_steps={args.steps}",
                              "checkpoint.every=2", f"checkpoint.async={mode}", "checkpoint.export=false")
            steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            times[mode] = steps
            saves = [line for line in result["stdout"].splitlines() if "committed in" in line or "saved in" in line]
            print(f"async={mode}: " + "; ".join(s.split("] ")[-1] for s in saves[:3]))
        # steps right after a save (odd steps > 1) run while an async save is in flight
        def mean(rows, pick):
            chosen = [r["step_time_s"] for r in rows if pick(r["step"])]
            return sum(chosen) / len(chosen)
        inflight = mean(times["true"], lambda s: s % 2 == 1 and s > 1)
        quiet = mean(times["false"], lambda s: s % 2 == 1 and s > 1)
        ratio = inflight / quiet
        print(f"step time with a save in flight {inflight:.2f}s vs the same steps with synchronous saves "
              f"{quiet:.2f}s (checkpoint time excluded): {ratio:.2f}x; target <= 1.2x "
              f"{'PASS' if ratio <= 1.2 else 'FAIL'}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    a = sub.add_parser("async")
    a.add_argument("--steps", type=int, default=8)
    for p in (m, a):
        p.add_argument("--tmp", default=None, help="where the model and checkpoints go (several GiB)")
    args = ap.parse_args(argv)
    return memory(args) if args.what == "memory" else async_bench(args)


if __name__ == "__main__":
    sys.exit(main())
