"""What the runtime guard costs after its window: steps 3..20 of a tiny-model training loop with the
guard on (FTIMAGE_GUARD_STEPS=2, so those steps run after it let go) and off, in one run.

    python3 bench/guard_cost.py [--pairs 3] [--steps 20] [--tokens 512]

Each mode runs in its own process, activated the way the image does it (a site folder holding
the build's `ftimage-app.pth` and `guard.install_files()`); the two processes take turns, one step
each, so load that drifts on a shared machine hits both alike, and the ratio is the median of the
ratios of neighbouring steps. The loop trains packed rows (contracts.collate) through the CPU
kernel doubles of tests/guard/kernels (the guard would refuse the torch fallback on packed rows),
one thread. It prints the median step time of each mode and their ratio (target: <= 1.01 on CPU).
Not a test: two shared cores are noisy; read the ratio with the spread it prints.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "tests" / "guard" / "kernels" / "fused"


def worker(tokens: int) -> None:
    """One measured process: the guard comes from the site folder given in argv."""
    import site

    site.addsitedir(sys.argv[2])
    sys.path.insert(0, str(KERNELS))
    import torch

    torch.set_num_threads(1)
    import flash_attn  # the test double, registered as flash_attention_2

    from contracts.collate import Document, collate_packed
    from families import load_family
    from families.runtime import build_model

    family = load_family("qwen3_5_text")
    model = build_model(family, "tiny", attn_implementation="sdpa").train()
    module = sys.modules[family.modeling_module]
    captured = module.causal_conv1d_fn    # held from before the window ended, as TRL holds a model's forward
    flash_attn.register()
    model.config._attn_implementation = "flash_attention_2"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    lengths = [tokens // 4, tokens // 4 + 16, tokens // 2 - 32]
    docs = [Document(ids := torch.randint(1, 500, (n,), generator=g).tolist(), ids) for n in lengths]
    def step() -> float:
        batch = collate_packed(docs, budget=tokens, pad_token_id=0)
        start = time.perf_counter()
        model(**batch, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(), step()                         # steps 1 and 2: the guard's window, when it is on
    from guard import activate

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:                 # steps 3..: one per request, so the two modes alternate closely
        if line.strip() != "step":
            break
        print(json.dumps({"time": step()}), flush=True)
    active = activate.CURRENT is not None and activate.CURRENT.active
    print(json.dumps({"guard_attached": activate.CURRENT is not None, "checking": active,
                      "residual_s": residual_per_call(captured) if activate.CURRENT is not None else None}), flush=True)


def residual_per_call(captured) -> float:
    """Seconds a wrapper captured before the window ended adds to each call after it (its flag
    check and one more Python frame), on a call of the conv's size in the tiny model."""
    import timeit

    import torch

    plain = captured.__wrapped__
    x, w = torch.randn(1, 256, 64), torch.randn(256, 4)
    call = lambda f: f(x, w, None, activation="silu")
    best = {"plain": 1e9, "captured": 1e9}
    for _ in range(20):                    # interleaved, minimum of each: the least disturbed runs
        for name, f in (("plain", plain), ("captured", captured)):
            best[name] = min(best[name], timeit.timeit(lambda f=f: call(f), number=200) / 200)
    return best["captured"] - best["plain"]


def site_folder(root: Path) -> Path:
    import guard

    folder = root / "site"
    folder.mkdir()
    (folder / guard.APP_PTH).write_text(f"{REPO}\n")
    for name, data in guard.install_files().items():
        (folder / name).write_bytes(data)
    return folder


class Worker:
    def __init__(self, mode: str, folder: Path, args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTIMAGE_") and k != "PYTHONPATH"}
        env.update(FTIMAGE_GUARD=mode, FTIMAGE_GUARD_STEPS="2", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
        self.mode = mode
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(folder), "--tokens", str(args.tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env, cwd=REPO)
        self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the guard-{self.mode} worker died ({self.proc.wait()})")
        return json.loads(line)

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self.read()["time"]

    def finish(self) -> dict:
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        result = self.read()
        self.proc.wait()
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="on/off process pairs")
    parser.add_argument("--steps", type=int, default=20, help="last step; steps 3.. are timed")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per packed row")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.tokens)
        return
    sys.path.insert(0, str(REPO))
    times: dict[str, list[float]] = {"on": [], "off": []}
    ratios: list[float] = []
    residuals: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = site_folder(Path(tmp))
        for _ in range(args.pairs):
            workers = {mode: Worker(mode, folder, args) for mode in ("on", "off")}
            for n in range(3, args.steps + 1):
                # on, off, off, on, ...: neighbours in time, so load that drifts hits both alike
                order = ("on", "off") if n % 2 else ("off", "on")
                got = {mode: workers[mode].step() for mode in order}
                for mode in order:
                    times[mode].append(got[mode])
                ratios.append(got["on"] / got["off"])
            for mode, w in workers.items():
                result = w.finish()
                assert result["guard_attached"] == (mode == "on") and not result["checking"], result
                if result["residual_s"] is not None:
                    residuals.append(result["residual_s"])
    med = {mode: statistics.median(values) for mode, values in times.items()}
    spread = {mode: (min(values), max(values)) for mode, values in times.items()}
    for mode in ("on", "off"):
        print(f"guard {mode:>3}: median step {med[mode] * 1000:.2f} ms over {len(times[mode])} steps "
              f"(min {spread[mode][0] * 1000:.2f}, max {spread[mode][1] * 1000:.2f})")
    print(f"ratio on/off, steps 3..{args.steps}: median of {len(ratios)} adjacent-step ratios "
          f"{statistics.median(ratios):.4f}, ratio of medians {med['on'] / med['off']:.4f} (target <= 1.01)")
    # After the window the guard has undone its patches; only a wrapper captured earlier (TRL's
    # patched forward holds the model forward) still costs its flag check. 8 guarded calls a step
    # in the tiny model (2 model forwards, 2 conv, 2 delta rule, 2 attention) bound it.
    residual = statistics.median(residuals)
    print(f"residual after the window: {residual * 1e6:.2f} us per captured call; 8 a step = "
          f"{8 * residual / med['off'] * 100:.4f}% of a step")


if __name__ == "__main__":
    main()
