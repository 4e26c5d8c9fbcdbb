"""Write a lock that describes THIS environment (for tests, and for gpu_check.sh on a bare GPU box).

Real images get their lock from build/; this helper only records what is installed here, so the
environment check has something truthful to compare against.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import sys
from pathlib import Path

from verify.lock import BuildLock, LockedKernel, LockedPackage

# distribution -> (import name, kind, extension module, replaces, entry points). Facts about the
# kernel packages, used only to describe an environment that build/ did not make.
KNOWN_KERNELS = {
    "causal-conv1d": ("causal_conv1d", "cuda-extension", "causal_conv1d_cuda", ("causal_conv1d_fn",),
                      ("causal_conv1d_fwd", "causal_conv1d_bwd")),
    "fla-core": ("fla", "triton", "", ("chunk_gated_delta_rule",), ()),
    "flash-attn": ("flash_attn", "cuda-extension", "flash_attn_2_cuda", ("attention:flash_attention_2",),
                   ("varlen_fwd", "varlen_bwd")),
}


def _sha256(path: Path | None) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path and path.is_file() else ""


def lock_for_environment(*, image: str = "local", wheels: dict[str, Path] | None = None,
                         attn_implementation: str | None = None, target_archs: tuple[str, ...] = ()) -> BuildLock:
    import torch
    import transformers

    wheels = wheels or {}
    kernels = []
    for dist_name, (import_name, kind, ext, replaces, entry_points) in KNOWN_KERNELS.items():
        try:
            version = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        wheel = wheels.get(dist_name)
        sha = _sha256(wheel)
        kernels.append(LockedKernel(name=dist_name, version=version, kind=kind, import_name=import_name,
                                    key=sha, wheel=wheel.name if wheel else "", sha256=sha, extension_module=ext,
                                    entry_points=entry_points, replaces=replaces, archs=target_archs))
    packages = tuple(
        LockedPackage(name=name, version=importlib.metadata.version(name), filename="", sha256="")
        for name in ("torch", "transformers")
    )
    has_fa = any("attention:flash_attention_2" in k.replaces for k in kernels)
    return BuildLock(
        image=image, plan_key="local", python=f"{sys.version_info.major}.{sys.version_info.minor}",
        torch=torch.__version__, cuda=torch.version.cuda or "cpu", cxx11_abi=bool(torch.compiled_with_cxx11_abi()),
        compiler="unknown", transformers=transformers.__version__, model_family="qwen3_5_text",
        target_archs=target_archs,
        attn_implementation=attn_implementation or ("flash_attention_2" if has_fa else "sdpa"),
        kernels=tuple(kernels), packages=packages,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verify.envlock", description=__doc__)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--wheel", action="append", default=[], metavar="DIST=PATH",
                   help="record this wheel's sha256 for a kernel distribution")
    p.add_argument("--arch", action="append", default=[], help="target arch, e.g. sm_90; default: this GPU's")
    args = p.parse_args(argv)
    wheels = {}
    for item in args.wheel:
        name, _, path = item.partition("=")
        wheels[name] = Path(path)
    archs = tuple(args.arch)
    if not archs:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            archs = (f"sm_{major}{minor}",)
    args.out.write_text(lock_for_environment(wheels=wheels, target_archs=archs).to_json())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
