"""Two CI runners sharing a signed kernel and layer cache through a registry, side by side.

    python bench/org_cache.py [--image images/qwen27b] [--seed-downloads DIR] [--keep-work]

  registry  Debian's docker-registry (/usr/bin/docker-registry) on a free 127.0.0.1 port, with
            its own config and storage in a temp folder;
  runner A  a fresh clone of this repository at HEAD, an empty --cache, and an engine holding no
            image of the build (no bases, no kernel builder image, no older builds of IMAGE):
            `python -m build IMAGE --cache-registry R --sign KEY`, cold;
  runner B  another fresh clone at the same commit, another empty --cache, and the engine
            emptied the same way again: `python -m build IMAGE --cache-registry R --cache-key PUB`.
Prints both wall times and their ratio (B/A, target <= 0.25), the bytes B pulled from the
registry, what B compiled (from its build report's cache rows: it must be 0) and assembled,
and whether the two image IDs match (they must). Both runners clone one commit, so a commit
made while the benchmark runs changes neither. `--seed-downloads DIR` hard-links the same
downloads (wheels, sources, debs) into both caches, so the comparison is about what is built,
not the network. Exit 0 only when the IDs match, B compiled nothing and B/A <= 0.25.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from build.engine import connect  # noqa: E402
from build.resolve import load_plan  # noqa: E402

REGISTRY_BIN = Path("/usr/bin/docker-registry")
DOWNLOADS = ("wheels", "sources", "debs")


def start_registry(root: Path) -> tuple[str, subprocess.Popen]:
    if not REGISTRY_BIN.exists():
        sys.exit(f"{REGISTRY_BIN} is missing: apt-get install -y docker-registry (./dev setup does it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    config = root / "config.yml"
    config.write_text(f"version: 0.1\nlog: {{level: warn}}\n"
                      f"storage: {{filesystem: {{rootdirectory: {root}/storage}}}}\nhttp: {{addr: '{address}'}}\n")
    proc = subprocess.Popen([str(REGISTRY_BIN), "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(root / "registry.log", "wb"))  # noqa: SIM115 - lives as long as the run
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as answer:
                if answer.status == 200:
                    return address, proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"docker-registry did not answer on {address}: {(root / 'registry.log').read_text()[-2000:]}")


def keys(folder: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / "cache.key", folder / "cache.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def fresh_cache(root: Path, seed: Path | None) -> Path:
    from contracts import folder_guard

    folder_guard.claim(root, folder_guard.CACHE_MARKER, what="cache folder", option="--cache")
    for name in DOWNLOADS if seed else ():
        if (seed / name).is_dir():
            subprocess.run(["cp", "-al", str(seed / name), str(root / name)], check=True)
    return root


TARGET = 0.25   # runner B's wall time against runner A's


def clear_engine(engine, name: str, bases: tuple[str, ...]) -> int:
    """Remove what a fresh runner's engine does not hold: IMAGE's builds, the bases it needs
    (bootstrapped again from the deb lock) and every kernel builder image."""
    labels = [f"io.ftimage.image={name}", "io.ftimage.builder.closure",
              *(f"io.ftimage.base.name={base}" for base in bases)]
    removed = 0
    for label in labels:
        for image in engine.images_with_label(label):
            removed += bool(engine.remove(image["Id"]))
    return removed


def head_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def runner(label: str, image: str, commit: str, work: Path, seed: Path | None,
           extra: list[str]) -> tuple[float, dict]:
    clone = work / f"clone-{label}"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", "--detach", commit], check=True)
    cache = fresh_cache(work / f"cache-{label}", seed)
    command = [sys.executable, "-m", "build", image, "--json", "--cache", str(cache),
               "--out", str(work / f"out-{label}"), *extra]
    started = time.monotonic()
    done = subprocess.run(command, cwd=clone, capture_output=True, text=True)
    seconds = time.monotonic() - started
    (work / f"runner-{label}.log").write_text(done.stderr)
    if done.returncode != 0:
        sys.exit(f"runner {label} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout)


def made(report: dict, prefix: str) -> int:
    return sum(1 for name, state in report["cache"].items() if name.startswith(prefix) and state.startswith("miss"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default="images/qwen27b")
    p.add_argument("--seed-downloads", type=Path, default=None, help="hard-link wheels/sources/debs from this cache")
    p.add_argument("--keep-work", action="store_true", help="keep the temp folder (clones, caches, logs)")
    args = p.parse_args()
    spec = load_plan(REPO_ROOT / args.image, REPO_ROOT / "kernels_manifest.yaml").spec
    name = spec.name
    bases = tuple(base.bootstrap_name for base in (spec.builder_base, spec.runtime_base) if base.bootstrap_name)
    commit = head_commit()
    engine = connect()
    work = Path(tempfile.mkdtemp(prefix="ftimage-org-cache-"))
    address, registry = start_registry(work)
    repository = f"{address}/team/ftimage-cache"
    private, public = keys(work)
    try:
        removed_a = clear_engine(engine, name, bases)
        a_seconds, a = runner("a", args.image, commit, work, args.seed_downloads,
                              ["--cache-registry", repository, "--sign", str(private)])
        removed = clear_engine(engine, name, bases)
        b_seconds, b = runner("b", args.image, commit, work, args.seed_downloads,
                              ["--cache-registry", repository, "--cache-key", str(public)])
    finally:
        registry.terminate()
        registry.wait(timeout=30)
    rows = [("wall time (s)", f"{a_seconds:.1f}", f"{b_seconds:.1f}", f"{b_seconds / a_seconds:.2f}"),
            ("kernels compiled", made(a, "kernel:"), made(b, "kernel:"), ""),
            ("layers assembled", made(a, "layer "), made(b, "layer "), ""),
            ("registry hits", a["remote_cache"]["hits"], b["remote_cache"]["hits"], ""),
            ("MiB pulled from the registry", f"{a['remote_cache']['bytes_pulled'] / 2 ** 20:.1f}",
             f"{b['remote_cache']['bytes_pulled'] / 2 ** 20:.1f}", ""),
            ("MiB pushed to the registry", f"{a['remote_cache']['bytes_pushed'] / 2 ** 20:.1f}",
             f"{b['remote_cache']['bytes_pushed'] / 2 ** 20:.1f}", ""),
            ("image ID", a["image_id"][:19], b["image_id"][:19], "")]
    print(f"{args.image} at {commit[:12]}: runner A cold (--sign), runner B from the registry (--cache-key); "
          f"images removed from the engine (builds, bases, kernel builders): {removed_a} before A, {removed} before B"
          + (f"; downloads seeded from {args.seed_downloads}" if args.seed_downloads else ""))
    print(f"{'':<30} {'A':>20} {'B':>20} {'B/A':>6}")
    for row in rows:
        print(f"{row[0]:<30} {row[1]!s:>20} {row[2]!s:>20} {row[3]!s:>6}")
    same = a["image_id"] == b["image_id"]
    compiled = made(b, "kernel:")
    ratio = b_seconds / a_seconds
    print(f"image IDs {'MATCH' if same else 'DIFFER'}; runner B compiled {compiled} kernel(s); "
          f"B/A {ratio:.2f} ({'within' if ratio <= TARGET else 'OVER'} the target {TARGET})")
    if not args.keep_work:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work folder: {work}")
    return 0 if same and compiled == 0 and ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
