"""What bench/org_cache.py measures runner B against, and how it counts bytes.

  RegistryMeter  the bytes docker-registry sent (`http.response.written` of its GET requests, from
                 its info-level JSON log) between two marks of its log: one slice per phase;
  pull_floor     the physical floor: `docker pull REGISTRY/REPO@DIGEST` of the image runner A pushed;
  BuildKit       Debian's /usr/bin/docker with DOCKER_BUILDKIT=1 on a copy of runner A's rendered
                 context whose FROM lines name the bases pushed to the same registry, with inline
                 cache (`BUILDKIT_INLINE_CACHE=1`, final stage only) and `--cache-from` that registry.

Every docker command is Debian's CLI (/usr/bin/docker): its builtin BuildKit client needs no buildx.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCKER_CLI = Path("/usr/bin/docker")
SETTLE_SECONDS = 1.0   # docker-registry logs a request just after its response: let the last line land
FROM_RE = re.compile(r"^(FROM\s+)(\S+)(.*)$", re.IGNORECASE)
STEP_RE = re.compile(r"^#(\d+) \[([\w.-]+) +(\d+)/(\d+)\] (.+)$")


@dataclass
class Phase:
    """One timed runner: its wall time and the bytes it fetched, from the registry and from outside it."""
    name: str
    seconds: float
    registry_bytes: int
    outside_bytes: int
    image_id: str = ""
    notes: dict[str, Any] = field(default_factory=dict)


class RegistryMeter:
    """Slices of docker-registry's JSON log (its stderr at log level info), one per phase."""

    def __init__(self, log: Path):
        self.log = log

    def mark(self) -> int:
        time.sleep(SETTLE_SECONDS)
        return self.log.stat().st_size

    def sent(self, start: int, end: int) -> int:
        """Bytes the registry wrote in answer to GET requests logged between the two marks."""
        with self.log.open("rb") as fh:
            fh.seek(start)
            chunk = fh.read(end - start)
        total = 0
        for line in chunk.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("msg") == "response completed" and entry.get("http.request.method") == "GET":
                total += int(entry.get("http.response.written", 0))
        return total


def docker_cli(*args: str, log: Path | None = None, buildkit: bool = False) -> str:
    """Run Debian's docker CLI; its output (stdout and stderr) goes to `log` too. Exit on failure."""
    if not DOCKER_CLI.exists():
        sys.exit(f"{DOCKER_CLI} is missing: apt-get install -y docker.io (./dev setup does it)")
    env = {**os.environ, "DOCKER_BUILDKIT": "1" if buildkit else "0"}
    done = subprocess.run([str(DOCKER_CLI), *args], capture_output=True, text=True, env=env)
    output = done.stdout + done.stderr
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ docker {' '.join(args)}\n{output}\n")
    if done.returncode != 0:
        sys.exit(f"`docker {' '.join(args)}` failed (exit {done.returncode}): {output.strip()[-1500:]}")
    return output


def prune_builder() -> None:
    """Empty BuildKit's cache, as a fresh runner's engine has none."""
    docker_cli("builder", "prune", "-af")


def image_id(ref: str) -> str:
    return docker_cli("image", "inspect", "--format", "{{.Id}}", ref).strip()


def pull_floor(reference: str, meter: RegistryMeter, log: Path) -> Phase:
    """`docker pull` of what runner A pushed, into an engine that holds none of it: the floor."""
    start = meter.mark()
    started = time.monotonic()
    output = docker_cli("pull", reference, log=log)
    seconds = time.monotonic() - started
    # a layer another image in the engine holds (not this build's: another team's image on the same
    # base) is not downloaded: the floor is then lower than an empty engine's, and says so
    held = sum(line.endswith(": Already exists") for line in output.splitlines())
    return Phase("pull (floor)", seconds, meter.sent(start, meter.mark()), 0, image_id(reference),
                 {"layers_already_held": held})


def base_refs(dockerfile: Path) -> list[str]:
    """The images the Dockerfile's FROM lines name (not its own stages), in order, once each."""
    stages: set[str] = set()
    refs: list[str] = []
    for line in dockerfile.read_text().splitlines():
        match = FROM_RE.match(line.strip())
        if not match:
            continue
        words = match.group(3).split()
        if match.group(2).lower() not in stages and match.group(2) not in refs:
            refs.append(match.group(2))
        if len(words) == 2 and words[0].lower() == "as":
            stages.add(words[1].lower())
    return refs


def push_bases(refs: list[str], registry: str, log: Path) -> dict[str, str]:
    """Tag each base (still in the engine after runner A) into the registry and push it."""
    pushed = {}
    for ref in refs:
        if ":" not in ref or ref.startswith("bootstrap:"):
            sys.exit(f"runner A's Dockerfile names {ref!r}, not a base image tag: the build did not bootstrap "
                     "its bases; rerun without --skip-buildkit only on a build that made them")
        target = f"{registry}/team/{ref}"
        docker_cli("tag", ref, target, log=log)
        docker_cli("push", target, log=log)
        pushed[ref] = target
    return pushed


def buildkit_context(rendered: Path, dest: Path, bases: dict[str, str]) -> Path:
    """A copy of runner A's rendered context (hard links) whose FROM lines name the pushed bases."""
    if not (rendered / "Dockerfile").is_file():
        sys.exit(f"{rendered}/Dockerfile is missing: runner A's --out has no rendered context")
    subprocess.run(["cp", "-al", str(rendered), str(dest)], check=True)
    dockerfile = dest / "Dockerfile"
    lines = []
    for line in dockerfile.read_text().splitlines():
        match = FROM_RE.match(line.strip())
        lines.append(f"{match.group(1)}{bases.get(match.group(2), match.group(2))}{match.group(3)}"
                     if match else line)
    dockerfile.unlink()   # a hard link to A's own Dockerfile: never write through it
    dockerfile.write_text("\n".join(lines) + "\n")
    return dest


def wheelhouse_bytes(context: Path) -> int:
    """What the context brought from outside the registry: the wheelhouse, kernel wheels included."""
    return sum(p.stat().st_size for p in (context / "wheelhouse").glob("*.whl"))


def buildkit_steps(output: str) -> dict[str, Any]:
    """From `--progress plain`: each step `[stage n/m] INSTRUCTION` and whether BuildKit printed CACHED."""
    steps: dict[str, tuple[str, str]] = {}
    cached: set[str] = set()
    for line in output.splitlines():
        match = STEP_RE.match(line.strip())
        if match:
            steps[match.group(1)] = (match.group(2), match.group(5))
        elif line.strip().endswith(" CACHED") and line.startswith("#"):
            cached.add(line.split()[0][1:])
    runnable = {n: s for n, s in steps.items() if not s[1].upper().startswith("FROM ")}
    builder = [n for n, (stage, _) in runnable.items() if stage == "builder"]
    return {"steps": len(runnable), "cached": sum(n in cached for n in runnable),
            "builder_steps": len(builder), "builder_ran": any(n not in cached for n in builder)}


def buildkit_run(label: str, context: Path, target: str, meter: RegistryMeter, log: Path) -> Phase:
    """One BuildKit build (cache from `target`, inline cache in what it makes) and its push to `target`."""
    start = meter.mark()
    started = time.monotonic()
    output = docker_cli("build", "--progress", "plain", "--network", "none",
                        "--build-arg", "BUILDKIT_INLINE_CACHE=1", "--cache-from", target, "-t", target,
                        str(context), log=log, buildkit=True)
    built = time.monotonic()
    docker_cli("push", target, log=log)
    pushed = time.monotonic()
    notes = {"build_seconds": round(built - started, 1), "push_seconds": round(pushed - built, 1),
             **buildkit_steps(output)}
    return Phase(label, built - started, meter.sent(start, meter.mark()), wheelhouse_bytes(context),
                 image_id(target), notes)
