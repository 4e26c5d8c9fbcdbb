"""`info`: a human summary of the image's build lock (or the raw lock with --json)."""
from __future__ import annotations

from dataclasses import asdict

from contracts.lock import BuildLock


def summarize(lock: BuildLock, path: str) -> str:
    lines = [
        f"image          {lock.image}",
        f"lock           {path} (sha256 {lock.sha256()[:12]})",
        f"plan key       {lock.plan_key[:16]}",
        f"python         {lock.python}",
        f"torch          {lock.torch}",
        f"cuda           {lock.cuda}",
        f"transformers   {lock.transformers}",
        f"model family   {lock.model_family} (attention: {lock.attn_implementation})",
        f"archs          {', '.join(lock.target_archs) or 'none (CPU image)'}",
        f"compiler       {lock.compiler}, cxx11 abi {lock.cxx11_abi}",
        f"kernels        {len(lock.kernels)}",
    ]
    for k in lock.kernels:
        archs = ",".join(k.archs) or "-"
        lines.append(f"  {k.name:<22} {k.version:<12} {k.kind:<15} key {k.key[:12]}  archs {archs}")
    lines.append(f"packages       {len(lock.packages)}")
    if lock.finetune_defaults:
        lines.append(f"finetune defaults {lock.finetune_defaults}")
    return "\n".join(lines)


def lock_json(lock: BuildLock) -> str:
    return lock.to_json()


def lock_summary_dict(lock: BuildLock) -> dict:
    """The small subset the run report records (the full lock stays in the image)."""
    d = asdict(lock)
    return {"image": lock.image, "plan_key": lock.plan_key, "sha256": lock.sha256(), "torch": lock.torch,
            "cuda": lock.cuda, "transformers": lock.transformers, "attn_implementation": lock.attn_implementation,
            "kernels": [{"name": k["name"], "version": k["version"], "key": k["key"]} for k in d["kernels"]]}
