"""What the trainer costs at size, measured with the project's own `finetune` on CPU (gloo ranks).

    python bench/scale.py memory [--worlds 2 4]   peak host RSS per rank: load, steps, export (0.8B hybrid)
    python bench/scale.py async  [--steps 8]      step time with an async checkpoint in flight vs without (0.3B)

memory: a 0.82B Qwen3.5 hybrid (20 layers, 15 gated-delta + 5 attention, head_dim 256) written as
bf16 safetensors, trained 2 steps and exported, once per world size. Each rank reports its peak
RSS at the end of load, of the steps and of the export (run_report.json host_peak_rss_gib).
Target per rank: <= 1.2 x (params x 4 bytes / world) + 2 GiB for load and export; over the whole
run, rank 0 within 1.2x of the other ranks (no rank gathers the model).

async: a 0.29B hybrid, checkpoint.every=2 with checkpoint.async=true vs false, the same steps;
reports the mean step time of steps that ran while a save was in flight against steps with none,
and each save's time and size. Target: <= 1.2x.
"""
from __future__ import annotations

import argparse
import json
import os
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


def memory(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.tmp) as tmp:
        root = Path(tmp)
        model_dir, n_params = make_model(root, "0.8b")
        weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        print(f"model: {n_params / 1e9:.3f}B params, bf16 safetensors {weights / 2 ** 30:.2f} GiB")
        ok = True
        for world in args.worlds:
            result = finetune(root, model_dir, root / f"out-{world}", f"launch.nproc_per_node={world}",
                              "train.max_steps=2", "checkpoint.every=0", "checkpoint.export_dtype=bfloat16")
            peaks = result["report"]["host_peak_rss_gib"]
            bound = 1.2 * n_params * 4 / world / 2 ** 30 + 2
            print(f"world {world}: bound {bound:.2f} GiB per rank (1.2 x params x 4 B / {world} + 2 GiB); "
                  f"first step after {result['report']['summary']['time_to_first_step_seconds']}s")
            for phase in ("load", "steps", "export"):
                values = peaks[phase]
                verdict = "PASS" if phase == "steps" or max(values) <= bound else "FAIL"
                ok &= verdict == "PASS"
                print(f"  peak RSS by the end of {phase:<6}: " + ", ".join(f"rank {r} {v:.2f}" for r, v in
                                                                       enumerate(values)) + f" GiB  {verdict}")
            whole = peaks["export"]
            ratio = whole[0] / max(whole[1:])
            ok &= ratio <= 1.2
            print(f"  whole run: rank 0 / largest other rank = {ratio:.2f}x (target <= 1.2x) "
                  f"{'PASS' if ratio <= 1.2 else 'FAIL'}")
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
