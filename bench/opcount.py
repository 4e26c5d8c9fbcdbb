"""Fused vs fallback op counts and step time of the tiny model on a GPU (gpu_check.sh calls it).

    python -m verify.opcount [--fallback] [--steps 20] [--json]

--fallback makes fla and causal_conv1d fail to import BEFORE transformers is imported, so
transformers resolves its torch reference functions exactly as it does in a broken image, and
runs attention on sdpa; comparing the two runs shows what the fallback costs in kernel launches
and time.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import time

# flash_attn is not hidden: the fallback run simply uses sdpa, and transformers imports any
# metadata-less flash_attn eagerly at its own import (utils/import_utils._is_package_available).
HIDDEN_FOR_FALLBACK = ("fla", "causal_conv1d")


class _BrokenLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(f"{module.__name__} hidden by verify.opcount --fallback")


class _Hide(importlib.abc.MetaPathFinder):
    """Makes the fused packages look installed-but-broken: find_spec succeeds (transformers'
    availability probes must not crash), the import itself raises, as with an ABI mismatch."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in HIDDEN_FOR_FALLBACK:
            return None
        if importlib.machinery.PathFinder.find_spec(name, path) is None:
            return None  # not installed: nothing to hide
        return importlib.machinery.ModuleSpec(name, _BrokenLoader())


def measure(fallback: bool, steps: int, device: str = "cuda", warmup: int = 3) -> dict:
    if fallback:
        sys.meta_path.insert(0, _Hide())
    import torch

    from contracts.collate import collate_packed
    from verify.calltrace import innermost_code
    from verify.checks.dispatch import read_resolution
    from verify.families import default_family, load_family
    from verify.kernel_profile import matching, profile_phases
    from verify.packing_probe import token_loss_sum
    from verify.tiny_model import batch_to, build_tiny_model, model_dtype, modeling_module, sample_documents

    family = load_family(default_family())
    module = modeling_module(family)
    resolutions = {f.replaces: read_resolution(module, f.wrapper) for f in family.required_fused}
    attn = "sdpa" if fallback else family.attention.implementation
    try:
        model = build_tiny_model(family, attn_implementation=attn, device=device, dtype=model_dtype(device)).train()
    except ImportError as exc:
        attn = f"sdpa (wanted {attn}: {exc})"
        model = build_tiny_model(family, attn_implementation="sdpa", device=device, dtype=model_dtype(device)).train()
    batch = batch_to(collate_packed(sample_documents((40, 24, 33), model.config.vocab_size), budget=112,
                                    pad_token_id=0), device)
    labels = batch.pop("labels")

    def forward():
        return token_loss_sum(model(**batch, use_cache=False).logits, labels)

    def backward(loss):
        loss.backward()
        model.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):  # Triton JIT + autotune happen here, not in the timed steps
        backward(forward())
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        backward(forward())
    sync()
    step_ms = (time.perf_counter() - start) * 1000 / steps

    watched = {f"{f.replaces}:torch": innermost_code(resolutions[f.replaces].torch_function)
               for f in family.required_fused}
    prof = profile_phases(forward, backward, watched, device=device)
    per_op = {}
    for f in family.required_fused:
        per_op[f.replaces] = {
            "resolved": "fused" if resolutions[f.replaces].is_new else "torch",
            "fused_forward_launches": len(matching(prof.kernels.forward, f.forward_kernels)),
            "fused_backward_launches": len(matching(prof.kernels.backward, f.backward_kernels)),
            "torch_reference_calls": prof.torch_reference_calls.get(f"{f.replaces}:torch", 0),
        }
    a = family.attention
    per_op[a.replaces] = {
        "resolved": model.config._attn_implementation,
        "fused_forward_launches": len(matching(prof.kernels.forward, a.forward_kernels)),
        "fused_backward_launches": len(matching(prof.kernels.backward, a.backward_kernels)),
    }
    distinct = sorted(set(prof.kernels.forward + prof.kernels.backward))
    return {
        "mode": "fallback" if fallback else "fused", "attn_implementation": attn,
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
        "torch": torch.__version__,
        "step_ms": round(step_ms, 3), "steps_timed": steps,
        "kernel_launches_per_step": prof.launches, "forward_launches": len(prof.kernels.forward),
        "backward_launches": len(prof.kernels.backward), "ops": per_op,
        "distinct_kernels": [n[:160] for n in distinct],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verify.opcount", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fallback", action="store_true", help="hide the fused packages (torch reference path)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (Triton JIT and autotuning)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")
    p.add_argument("--device", default="cuda", help="cpu only for a dry run of this script: no GPU kernels exist there")
    args = p.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("opcount: no CUDA device; fix: run on a GPU host (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    result = measure(args.fallback, args.steps, args.device, args.warmup)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['mode']}: {result['step_ms']} ms/step, {result['kernel_launches_per_step']} kernel launches "
              f"per step ({result['forward_launches']} fwd, {result['backward_launches']} bwd)")
        for op, counts in result["ops"].items():
            print(f"  {op}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
