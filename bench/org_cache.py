"""Runner B (a registry cache) against a cold runner, the physical floor and BuildKit, in one run.

    python bench/org_cache.py [--image images/qwen27b] [--seed-downloads DIR] [--keep-work]
                              [--skip-buildkit] [--json-out PATH]

  registry  Debian's docker-registry (/usr/bin/docker-registry) on a free 127.0.0.1 port (dockerd
            treats 127.0.0.0/8 as insecure, so it pulls and pushes there over http), with its own
            config and storage in a temp folder and a JSON log at level info;
  runner A  a fresh clone of this repository at HEAD, an empty --cache, and an engine holding no
            image of the build (no bases, no kernel builder image, no older builds of IMAGE):
            `python -m build IMAGE --cache-registry R/team/ftimage-cache --sign KEY
            --push R/team/NAME`, cold;
  runner B  another fresh clone at the same commit, another empty --cache, and the engine
            emptied the same way again: `python -m build IMAGE --cache-registry R/... --cache-key PUB`;
  pull      the floor: the engine emptied again (and of A's pushed image), then
            `docker pull R/team/NAME@DIGEST`, the manifest digest A's push recorded (a layer
            that an image this bench does not remove holds, e.g. another build's base on the
            same Debian, is not downloaded: the table counts such layers);
  BuildKit  Debian's /usr/bin/docker with DOCKER_BUILDKIT=1 (no buildx needed) builds a copy of
            A's rendered context (`OUT-A/context`) whose FROM lines name A's bases, tagged and
            pushed to R/team/ftimage-base/... after A, with `--network none --progress plain
            --build-arg BUILDKIT_INLINE_CACHE=1 --cache-from R/team/NAME-buildkit:TAG`, then pushes
            that tag. Cold: the engine emptied (bases too) and `docker builder prune -af`, so the
            cache-from tag does not exist yet (BuildKit prints `ERROR: ... not found` for it and
            builds on); warm: emptied and pruned again, the same command, now with the image
            cold pushed as its cache. Inline cache holds the final stage only (mode=min); the
            table says whether each run ran the builder stage (a builder step BuildKit did not
            print CACHED for). Its wall time is the build; the push is noted.
            `--skip-buildkit` leaves both runs out.

Bytes per runner: from the registry, what docker-registry sent in answer to GET requests during
that runner (`http.response.written`, from that runner's slice of its log); from outside it, for
A and B the growth of their cache's download folders (wheels/, sources/, debs/: everything a build
downloads is stored there), for BuildKit the wheels in the context's wheelhouse, which it reads
from the context (they came from the package index or a compile).

Prints a table of each runner's wall time and bytes, the kernels each build compiled and the bases
it bootstrapped (from its build report's cache rows: a `base:` state starting "miss"), the image
IDs (A and B must match, and the pulled image is A's), and the ratios B/A, B/pull and
B/BuildKit-warm. `--json-out PATH` writes all of it as JSON. Every runner clones one commit, so a
commit made while the benchmark runs changes none of them. `--seed-downloads DIR` hard-links the
same downloads (wheels, sources, debs) into both caches, so the comparison is about what is built,
not the network; only what a runner adds to them counts as fetched from outside. Exit 0 only when
the IDs match, B compiled nothing, B <= 1.5 x pull and B <= BuildKit warm (unless skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.org_cache_baselines import (  # noqa: E402
    Phase,
    RegistryMeter,
    base_refs,
    buildkit_context,
    buildkit_run,
    prune_builder,
    pull_floor,
    push_bases,
)
from build.engine import connect  # noqa: E402
from build.resolve import load_plan  # noqa: E402

REGISTRY_BIN = Path("/usr/bin/docker-registry")
DOWNLOADS = ("wheels", "sources", "debs")
FLOOR_FACTOR = 1.5   # runner B's wall time against the plain pull's


def start_registry(root: Path) -> tuple[str, subprocess.Popen, RegistryMeter]:
    if not REGISTRY_BIN.exists():
        sys.exit(f"{REGISTRY_BIN} is missing: apt-get install -y docker-registry (./dev setup does it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    config, log = root / "config.yml", root / "registry.log"
    config.write_text(f"version: 0.1\nlog: {{level: info, formatter: json, accesslog: {{disabled: true}}}}\n"
                      f"storage: {{filesystem: {{rootdirectory: {root}/storage}}}}\nhttp: {{addr: '{address}'}}\n")
    proc = subprocess.Popen([str(REGISTRY_BIN), "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"))  # noqa: SIM115 - lives as long as the run
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as answer:
                if answer.status == 200:
                    return address, proc, RegistryMeter(log)
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"docker-registry did not answer on {address}: {log.read_text()[-2000:]}")


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


def download_bytes(cache: Path) -> int:
    """Bytes in the cache's download folders (what a build fetched from outside is stored there)."""
    return sum(p.stat().st_size for name in DOWNLOADS for p in (cache / name).rglob("*")
               if p.is_file() and not p.is_symlink())


def clear_engine(engine, name: str, bases: tuple[str, ...], refs: tuple[str, ...] = ()) -> int:
    """Remove what a fresh runner's engine does not hold: IMAGE's builds, the bases it needs
    (bootstrapped again from the deb lock), every kernel builder image and the named refs
    (what this bench tagged, pushed or pulled)."""
    labels = [f"io.ftimage.image={name}", "io.ftimage.builder.closure",
              *(f"io.ftimage.base.name={base}" for base in bases)]
    removed = 0
    for label in labels:
        for image in engine.images_with_label(label):
            removed += bool(engine.remove(image["Id"]))
    return removed + sum(bool(engine.remove(ref)) for ref in refs)


def head_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def made(report: dict, prefix: str) -> int:
    return sum(1 for name, state in report["cache"].items() if name.startswith(prefix) and state.startswith("miss"))


def bootstrapped(report: dict) -> list[str]:
    """The bases this build bootstrapped: its `base:` cache rows whose state starts with "miss"."""
    return [name.split(":", 1)[1] for name, state in report["cache"].items()
            if name.startswith("base:") and state.startswith("miss")]


def runner(label: str, image: str, commit: str, work: Path, seed: Path | None, meter: RegistryMeter,
           extra: list[str]) -> tuple[Phase, dict]:
    clone = work / f"clone-{label}"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", "--detach", commit], check=True)
    cache = fresh_cache(work / f"cache-{label}", seed)
    command = [sys.executable, "-m", "build", image, "--json", "--cache", str(cache),
               "--out", str(work / f"out-{label}"), *extra]
    before, start = download_bytes(cache), meter.mark()
    started = time.monotonic()
    done = subprocess.run(command, cwd=clone, capture_output=True, text=True)
    seconds = time.monotonic() - started
    (work / f"runner-{label}.log").write_text(done.stderr)
    if done.returncode != 0:
        sys.exit(f"runner {label} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    notes = {"kernels_compiled": made(report, "kernel:"), "layers_assembled": made(report, "layer "),
             "bases_bootstrapped": bootstrapped(report), "registry_hits": report["remote_cache"]["hits"],
             "cache": report["cache"]}
    phase = Phase(f"{label.upper()} {'cold' if label == 'a' else 'registry'}", seconds,
                  meter.sent(start, meter.mark()), download_bytes(cache) - before, report["image_id"], notes)
    return phase, report


def buildkit_phases(engine, name: str, bases: tuple[str, ...], a: dict, address: str, work: Path,
                    meter: RegistryMeter, pushed_bases: dict[str, str], refs: tuple[str, ...]) -> list[Phase]:
    """BuildKit cold, then warm, each from an emptied engine and an empty builder cache."""
    context = buildkit_context(work / "out-a" / "context", work / "context-buildkit", pushed_bases)
    target = f"{address}/team/{name}-buildkit:{a['tag'].split(':', 1)[1]}"
    log = work / "buildkit.log"
    phases = []
    for label in ("BuildKit cold", "BuildKit warm"):
        clear_engine(engine, name, bases, (*refs, *pushed_bases.values(), target))
        prune_builder()
        phases.append(buildkit_run(label, context, target, meter, log))
    clear_engine(engine, name, bases, (target,))
    return phases


def mib(count: int) -> str:
    return f"{count / 2 ** 20:,.1f}"


def did(phase: Phase) -> str:
    notes = phase.notes
    if "kernels_compiled" in notes:
        booted = ", ".join(notes["bases_bootstrapped"]) or "none"
        return (f"{notes['kernels_compiled']} kernel(s) compiled, {notes['layers_assembled']} layer(s) assembled, "
                f"{notes['registry_hits']} registry hit(s), bases bootstrapped: {booted}")
    if "steps" in notes:
        return (f"{notes['cached']}/{notes['steps']} steps CACHED, builder stage "
                f"{'ran' if notes['builder_ran'] else 'CACHED'}; push {notes['push_seconds']} s after")
    held = notes.get("layers_already_held", 0)
    return "docker pull by digest" + (f"; {held} layer(s) not fetched: another image in the engine holds them"
                                      if held else "")


def print_table(phases: list[Phase]) -> None:
    print(f"{'runner':<16} {'wall s':>9} {'registry MiB':>13} {'outside MiB':>12}  {'image ID':<19}  what it did")
    for phase in phases:
        print(f"{phase.name:<16} {phase.seconds:>9.1f} {mib(phase.registry_bytes):>13} "
              f"{mib(phase.outside_bytes):>12}  {phase.image_id[:19]:<19}  {did(phase)}")


def ratios(phases: dict[str, Phase]) -> dict[str, float | None]:
    b = phases["B registry"].seconds
    warm = phases.get("BuildKit warm")
    return {"B/A": round(b / phases["A cold"].seconds, 3), "B/pull": round(b / phases["pull (floor)"].seconds, 3),
            "B/BuildKit warm": round(b / warm.seconds, 3) if warm else None}


def verdict(phases: dict[str, Phase], ratio: dict[str, float | None]) -> dict[str, bool]:
    warm = ratio["B/BuildKit warm"]
    return {"image IDs match": phases["A cold"].image_id == phases["B registry"].image_id,
            "B compiled nothing": phases["B registry"].notes["kernels_compiled"] == 0,
            f"B <= {FLOOR_FACTOR} x pull": ratio["B/pull"] <= FLOOR_FACTOR,
            "B <= BuildKit warm": warm is None or warm <= 1.0}


def write_json(path: Path, result: dict, phases: list[Phase]) -> None:
    """The whole result, for committing beside bench/RESULTS.md."""
    phase_rows = [{**asdict(phase), "seconds": round(phase.seconds, 2)} for phase in phases]
    path.write_text(json.dumps({**result, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
                                "phases": phase_rows}, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default="images/qwen27b")
    p.add_argument("--seed-downloads", type=Path, default=None, help="hard-link wheels/sources/debs from this cache")
    p.add_argument("--keep-work", action="store_true", help="keep the temp folder (clones, caches, logs)")
    p.add_argument("--skip-buildkit", action="store_true", help="leave out the two BuildKit runs (a quick run)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the whole result as JSON to this file")
    return p.parse_args()


def run_all(args: argparse.Namespace, name: str, bases: tuple[str, ...], commit: str, work: Path, address: str,
            meter: RegistryMeter) -> tuple[list[Phase], dict]:
    """A (which pushes the image, and then its bases for BuildKit), B, the pull, BuildKit cold and warm;
    the engine emptied before each."""
    engine = connect()
    cache_repo, image_repo = f"{address}/team/ftimage-cache", f"{address}/team/{name}"
    private, public = keys(work)
    clear_engine(engine, name, bases)
    a, a_report = runner("a", args.image, commit, work, args.seed_downloads, meter,
                         ["--cache-registry", cache_repo, "--sign", str(private), "--push", image_repo])
    reference = a_report.get("pushed", {}).get("reference")
    if not reference:
        sys.exit("runner A's build report records no push: check `--push` in `python -m build --help`")
    pushed_bases = {} if args.skip_buildkit else \
        push_bases(base_refs(work / "out-a" / "context" / "Dockerfile"), address, work / "bases.log")
    refs = (reference, image_repo, *pushed_bases.values())
    clear_engine(engine, name, bases, refs)
    b, _ = runner("b", args.image, commit, work, args.seed_downloads, meter,
                  ["--cache-registry", cache_repo, "--cache-key", str(public)])
    clear_engine(engine, name, bases, refs)
    phases = [a, b, pull_floor(reference, meter, work / "pull.log")]
    clear_engine(engine, name, bases, refs)
    if not args.skip_buildkit:
        phases += buildkit_phases(engine, name, bases, a_report, address, work, meter, pushed_bases, refs)
    return phases, a_report


def summarise(args: argparse.Namespace, commit: str, headline: str, phases: list[Phase], a_report: dict) -> bool:
    """Print the table, the ratios and the checks (and write the JSON); True when every check passes."""
    by_name = {phase.name: phase for phase in phases}
    ratio = ratios(by_name)
    checks = verdict(by_name, ratio)
    pulled = by_name["pull (floor)"].image_id == by_name["A cold"].image_id
    print(headline)
    print_table(phases)
    print("  ".join(f"{k} {v:.2f}" if v is not None else f"{k} skipped" for k, v in ratio.items()))
    print("  ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in checks.items())
          + f"  (the pulled image {'is' if pulled else 'is NOT'} A's)")
    if args.json_out:
        write_json(args.json_out, {"image": args.image, "commit": commit, "headline": headline,
                                   "pushed": a_report["pushed"], "ratios": ratio, "checks": checks,
                                   "pulled_image_is_a": pulled}, phases)
    return all(checks.values())


def main() -> int:
    args = parse_args()
    spec = load_plan(REPO_ROOT / args.image, REPO_ROOT / "kernels_manifest.yaml").spec
    bases = tuple(base.bootstrap_name for base in (spec.builder_base, spec.runtime_base) if base.bootstrap_name)
    commit = head_commit()
    work = Path(tempfile.mkdtemp(prefix="ftimage-org-cache-"))
    address, registry, meter = start_registry(work)
    started = time.monotonic()
    try:
        phases, a_report = run_all(args, spec.name, bases, commit, work, address, meter)
    finally:
        registry.terminate()
        registry.wait(timeout=30)
    headline = (f"{args.image} at {commit[:12]} on {os.cpu_count()} cores, registry {address}, "
                f"whole run {time.monotonic() - started:.0f} s"
                + (f"; downloads seeded from {args.seed_downloads}" if args.seed_downloads else ""))
    passed = summarise(args, commit, headline, phases, a_report)
    if args.keep_work:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
