"""The GPU proof kit's training phase: the image's own `finetune` on the GPU host, as a user runs it.

    python3 bench/kit_finetune.py --work DIR --json-out FILE [--rehearse]

1. Writes the family's bench flavour (the real layer layout: gated-delta and full-attention
   layers, head_dim 256) as a bf16 HF checkpoint, a chat tokenizer, and ultrachat-shaped chat data
   (bench/packing_efficiency.py's length model) for 8192-token micro-batches.
2. Run A: `python -m entrypoint finetune` with no override (verify must pass: the run report must
   show the fused kernels and flash_attention_2), packed, FSDP2 on one rank, full activation
   checkpointing, bf16; SIGTERM at step 16 of 32 (a checkpoint, exit 143), the same command again
   (resume), then the HF export; the export is reloaded with transformers and generates 20 tokens.
3. Runs B and C: the first 20 steps on 2D padded batches, fused (B) and with fla and causal-conv1d
   hidden (C, --allow-fallback, as in a broken image; attention stays flash-attn); their losses
   must agree to bf16 tolerance.
One H200 runs world size 1 (NCCL refuses two ranks on one GPU), so multi-rank NCCL stays unproven
here. --rehearse does the same on CPU with the tiny flavour (verify cannot pass there, so every run
uses --allow-fallback) to prove the control flow.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
HIDE_SITE = Path(__file__).resolve().parent / "kit_site"   # sitecustomize: hide the fused packages
LOSS_TOLERANCE = 2e-2    # relative, bf16 fused kernels vs the torch references


def write_inputs(work: Path, *, rehearse: bool, budget: int, n_docs: int) -> Path:
    """Model, tokenizer, data and the finetune config; returns the config path."""
    import numpy as np
    import torch
    import yaml

    from bench.packing_efficiency import synthetic_ultrachat
    from families import load_family
    from families.runtime import build_model
    from tests.fixtures.chat import _WORDS, write_tokenizer

    flavour = "tiny" if rehearse else "bench"
    # one folder per flavour, published by rename: a phase killed while saving leaves no model
    # that a retry would take for whole, and a rehearsal's model never stands in for the real one
    model_dir = work / f"model-{flavour}"
    if not (model_dir / "config.json").is_file():
        staging = work / f".model-{flavour}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        write_tokenizer(staging, [" ".join(_WORDS)] * 64)
        model = build_model(load_family("qwen3_5_text"), flavour, attn_implementation="sdpa",
                            dtype=torch.float32 if rehearse else torch.bfloat16, seed=0)
        model.save_pretrained(str(staging))
        staging.rename(model_dir)
    rng = np.random.default_rng(0)
    lengths = np.minimum(synthetic_ultrachat(n_docs, chars_per_token=4.0, sigma=0.55, seed=0), budget - 64)
    with (work / "data.jsonl").open("w") as fh:
        for n in lengths:
            words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), int(n))]
            half = max(1, len(words) // 3)
            fh.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[:half])},
                                              {"role": "assistant", "content": " ".join(words[half:]) or "ok"}]})
                     + "\n")
    config = {"model": {"path": str(model_dir)},
              "data": {"path": str(work / "data.jsonl"), "max_length": budget},
              "packing": {"budget": budget},
              "train": {"lr": 1e-4, "warmup_steps": 2, "seed": 0},
              "parallel": {"param_dtype": "float32" if rehearse else "bfloat16", "activation_checkpoint": "full"},
              "checkpoint": {"keep": 2, "export_dtype": "bfloat16"},
              "output": {"log_every": 1}, "launch": {"nproc_per_node": 1}}
    path = work / "finetune.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


RUNS = ("run-a", "run-b", "run-c")


def clear_runs(work: Path) -> None:
    """Remove the runs an earlier attempt left (the model and data are kept: they are the same inputs).

    A retried phase must not see an old run's metrics: it would send SIGTERM before the new run
    installs its handler, and resume from a checkpoint this attempt never wrote."""
    for name in RUNS:
        shutil.rmtree(work / name, ignore_errors=True)
        (work / f"{name}.log").unlink(missing_ok=True)


def finetune(config: Path, out: Path, *extra: str, env: dict, stop_at: int | None = None) -> dict:
    """One `python -m entrypoint finetune`; with stop_at, SIGTERM the launcher once that step is logged."""
    argv = [sys.executable, "-m", "entrypoint", "finetune", "--config", str(config), f"output.dir={out}", *extra]
    started = time.monotonic()
    log = (out.parent / f"{out.name}.log").open("a")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if stop_at is not None:
        while proc.poll() is None:
            if any(m.get("step", 0) >= stop_at for m in metrics(out)):
                proc.send_signal(signal.SIGTERM)   # what `docker stop` sends PID 1
                break
            time.sleep(0.05)
    code = proc.wait()
    report = json.loads((out / "run_report.json").read_text()) if (out / "run_report.json").is_file() else {}
    return {"exit_code": code, "seconds": round(time.monotonic() - started, 1), "report": report}


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return [r for r in rows if r.get("kind", "train") == "train"]


def generate(export: Path, rehearse: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cpu" if rehearse else "cuda"
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32 if rehearse else torch.bfloat16,
                                                 attn_implementation="sdpa" if rehearse else "flash_attention_2")
    model.to(device).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "red blue tree"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    new = out[0, ids.shape[1]:]
    return {"new_tokens": int(new.numel()), "text": tokenizer.decode(new), "use_cache": model.config.use_cache}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json-out", type=Path, required=True)
    ap.add_argument("--rehearse", action="store_true")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    budget, docs, steps, stop_at, compare = (512, 200, 8, 4, 5) if args.rehearse else (8192, 600, 32, 16, 20)
    config = write_inputs(args.work, rehearse=args.rehearse, budget=budget, n_docs=docs)
    clear_runs(args.work)
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    override = ["--allow-fallback"] if args.rehearse else []   # on a GPU host verify must pass on its own
    result: dict = {"rehearsal": args.rehearse, "budget": budget, "steps": steps}

    def save() -> None:
        args.json_out.write_text(json.dumps(result, indent=2, default=str))

    a = args.work / "run-a"
    common = [*override, f"train.max_steps={steps}", "checkpoint.every=8"]
    first = finetune(config, a, *common, env=env, stop_at=stop_at)
    result["a_stopped"] = {"exit_code": first["exit_code"], "seconds": first["seconds"],
                           "interrupted": first["report"].get("interrupted"),
                           "final_step": first["report"].get("final_step")}
    save()
    second = finetune(config, a, *common, env=env)
    report = second["report"]
    result["a_resumed"] = {"exit_code": second["exit_code"], "seconds": second["seconds"],
                           "resumed_from": report.get("resumed_from"), "final_step": report.get("final_step"),
                           "verify_passed": report.get("verify", {}).get("passed"),
                           "allow_fallback": report.get("allow_fallback"),
                           "attn_implementation": report.get("attn_implementation"),
                           "packing": report.get("packing_mode"), "summary": report.get("summary"),
                           "exported": report.get("exported")}
    save()
    if report.get("exported"):
        result["generate"] = generate(Path(report["exported"]), args.rehearse)
        save()
    padded = [*override, "packing.mode=padded", f"train.max_steps={compare}", "checkpoint.every=0",
              "checkpoint.export=false"]
    fused = finetune(config, args.work / "run-b", *padded, env=env)
    hidden = finetune(config, args.work / "run-c", "--allow-fallback", *padded[len(override):],
                      env={**env, "PYTHONPATH": f"{HIDE_SITE}{os.pathsep}{env.get('PYTHONPATH', '')}"})
    b = {m["step"]: m["loss"] for m in metrics(args.work / "run-b")}
    c = {m["step"]: m["loss"] for m in metrics(args.work / "run-c")}
    worst = max((abs(b[s] - c[s]) / max(abs(c[s]), 1e-6) for s in b if s in c), default=None)
    result["losses"] = {"fused_padded": b, "fallback_padded": c, "max_rel_diff": worst, "tolerance": LOSS_TOLERANCE,
                        "agree": worst is not None and worst <= LOSS_TOLERANCE and len(b) == len(c) == compare,
                        "fused_exit": fused["exit_code"], "fallback_exit": hidden["exit_code"],
                        "fallback_hid": hidden["report"].get("verify", {}).get("passed") is False}
    save()
    ok = (result["a_stopped"]["exit_code"] == 143 and result["a_resumed"]["exit_code"] == 0
          and result.get("generate", {}).get("new_tokens") == 20 and result["losses"]["agree"]
          and (args.rehearse or (result["a_resumed"]["verify_passed"] and not result["a_resumed"]["allow_fallback"]
                                 and result["a_resumed"]["attn_implementation"] == "flash_attention_2"
                                 and result["a_resumed"]["packing"] == "packed")))
    result["ok"] = bool(ok)
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
