"""The image assembler against the classic builder, side by side in one run.

    python bench/build_cache.py [images/smoke] [--seed-cache DIR]

For each builder (classic `--builder dockerfile`, then the assembler `--builder oci`):
  cold    a fresh cache seeded with the wheels, sources and kernels of --seed-cache (hard links:
          both builders start from the same downloads), the image, its older builds and the
          builder stages removed from the engine: the image phase does all its work;
  warm    the same command again, nothing changed;
  commit  SOURCE_DATE_EPOCH moved by an hour, as a new commit does: what is rebuilt, and the
          seconds until `docker run IMAGE info` answers.
Prints seconds per measure for both builders and their ratio. The bases are shared (both
builders start from the same bootstrapped base). Each build is the CLI a user runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from build.cache import default_cache_root  # noqa: E402
from build.engine import connect  # noqa: E402
from build.resolve import load_plan  # noqa: E402

SEEDED = ("wheels", "sources", "resolutions", "kernels")


def seeded_cache(root: Path, seed: Path) -> Path:
    root.mkdir(parents=True)
    for name in SEEDED:
        if (seed / name).is_dir():
            subprocess.run(["cp", "-al", str(seed / name), str(root / name)], check=True)
    return root


def build(image_dir: str, cache: Path, out: Path, builder: str, epoch: int) -> tuple[float, dict]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "build", image_dir, "--json", "--cache", str(cache), "--out",
                           str(out), "--builder", builder], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)})
    if done.returncode != 0:
        sys.exit(f"{builder} build failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - started, json.loads(done.stdout)


def clear_engine(engine, name: str) -> None:
    for image in engine.images_with_label(f"io.ftimage.image={name}"):
        engine.remove(image["Id"])


def measure(image_dir: str, builder: str, seed: Path, work: Path, engine, name: str) -> dict[str, float | str]:
    epoch = int(time.time()) + 86400
    clear_engine(engine, name)
    cache = seeded_cache(work / f"cache-{builder}", seed)
    cold, cold_report = build(image_dir, cache, work / f"out-{builder}-1", builder, epoch)
    warm, _ = build(image_dir, cache, work / f"out-{builder}-2", builder, epoch)
    commit, commit_report = build(image_dir, cache, work / f"out-{builder}-3", builder, epoch + 3600)
    started = time.monotonic()
    answered = engine.run(commit_report["tag"], ["info"])
    runs = commit + time.monotonic() - started
    if answered.exit_code != 0:
        sys.exit(f"{builder}: `info` failed in the rebuilt image:\n{answered.output[-2000:]}")
    rebuilt = [k.split()[1].split(":")[0] for k, v in commit_report["cache"].items()
               if k.startswith("layer ") and v == "miss"]
    return {"cold build (s)": cold, "cold image phase (s)": cold_report["phase_seconds"]["image"],
            "warm build (s)": warm, "commit: image phase (s)": commit_report["phase_seconds"]["image"],
            "commit: until `info` runs (s)": runs,
            "rebuilt after the commit": ", ".join(rebuilt) or ("image" if builder == "dockerfile" else "-"),
            "image size (GiB)": cold_report["size_bytes"] / 2 ** 30}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image_dir", nargs="?", default="images/smoke")
    parser.add_argument("--seed-cache", type=Path, default=default_cache_root(),
                        help="where the wheels, sources and kernels come from (default: the build's cache)")
    args = parser.parse_args()
    plan = load_plan(REPO_ROOT / args.image_dir)
    engine = connect()
    with tempfile.TemporaryDirectory(prefix="ftimage-bench-", dir=str(args.seed_cache.parent)) as tmp:
        results = {}
        for builder in ("dockerfile", "oci"):
            print(f"{builder}: cold, warm, commit ...", flush=True)
            results[builder] = measure(args.image_dir, builder, args.seed_cache, Path(tmp), engine, plan.spec.name)
        shutil.rmtree(tmp, ignore_errors=True)
    classic, oci = results["dockerfile"], results["oci"]
    print(f"\n{plan.spec.name}: {'measure':<32} {'classic':>10} {'assembler':>10} {'ratio':>7}")
    for key in classic:
        if isinstance(classic[key], str):
            print(f"{'':<{len(plan.spec.name) + 2}}{key:<32} {classic[key]:>10} {oci[key]:>10}")
        else:
            ratio = oci[key] / classic[key] if classic[key] else float("nan")
            print(f"{'':<{len(plan.spec.name) + 2}}{key:<32} {classic[key]:>10.1f} {oci[key]:>10.1f} {ratio:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
