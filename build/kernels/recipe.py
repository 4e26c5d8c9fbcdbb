"""The compile recipe for one kernel: unpack the pinned sdist, apply the pinned patches, build
a wheel against the torch already installed, record what it was built with, and run the
GPU-free checks on the result. The same recipe runs in a builder container (driven by
compile.py through the Docker engine) and directly on a host (`python -m build kernels
build-here`), so both build with the same knobs, specialisation and checks.

Standalone on purpose: it runs under the builder's or the host's Python, so it imports only
the standard library (and torch, where it records versions).

    python recipe.py --sdist SDIST --patches DIR --out DIR --work DIR
                     [--env KEY=VALUE ...] [--jobs N] [--check-config JSON]

Writes OUT/dist/<wheel>, OUT/observed.json, and (with --check-config) prints the check rows
as one `FTIMAGE-CHECK [...]` line. Compiler progress streams to stdout as it happens; ninja
prints `[n/N elapsed]` per finished source (NINJA_STATUS below).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

NINJA_STATUS = "[%f/%t %es] "   # finished/total, elapsed seconds: parsed into progress events
SAFE_ENV = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def say(message: str) -> None:
    print(f"ftimage: {message}", flush=True)


def unpack(sdist: Path, dest: Path) -> Path:
    """Extract the sdist's single top folder into dest, refusing members that would land outside it."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        if len(tops) != 1:
            raise SystemExit(f"ftimage: {sdist.name} does not have a single top-level folder")
        try:
            tar.extractall(dest, filter="data")   # refuses absolute paths, '..', links out of dest
        except TypeError:  # Python < 3.11.4: check by hand
            for m in members:
                target = (dest / m.name).resolve()
                if not target.is_relative_to(dest.resolve()) or m.issym() or m.islnk():
                    raise SystemExit(f"ftimage: refusing sdist member {m.name!r}") from None
            tar.extractall(dest)  # noqa: S202 - every member checked above
    return dest / tops.pop()


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply_unified_diff(src: Path, diff: str, name: str) -> None:
    """Apply a `git diff`-style patch (-p1) exactly: every hunk's context must match, at its line
    or nearby (line numbers shift when an earlier patch touched the same file). No fuzz, so a
    patch that does not fit this sdist fails loudly instead of landing somewhere else. In
    Python, so a host without the `patch` program builds exactly like the builder image."""
    files: list[tuple[str, list[list[str]]]] = []
    lines_in = diff.splitlines()
    i = 0
    while i < len(lines_in):
        line = lines_in[i]
        i += 1
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0].strip()
            files.append((target[2:] if target.startswith("b/") else target, []))
            continue
        match = _HUNK.match(line)
        if not match or not files:
            continue  # diff --git / index / --- lines between files
        # a hunk holds exactly its old and new line counts; read no more, so the next file's
        # "--- a/..." header is never taken for a removed line
        old_left = int(match.group(2) or 1)
        new_left = int(match.group(4) or 1)
        hunk = [line]
        while (old_left or new_left) and i < len(lines_in):
            body = lines_in[i]
            i += 1
            if body.startswith("\\"):
                continue  # "\ No newline at end of file"
            hunk.append(body)
            if body.startswith("-"):
                old_left -= 1
            elif body.startswith("+"):
                new_left -= 1
            else:
                old_left -= 1
                new_left -= 1
        files[-1][1].append(hunk)
    for rel, hunks in files:
        path = (src / rel).resolve()
        if not path.is_relative_to(src.resolve()) or not path.is_file():
            raise SystemExit(f"ftimage: patch {name} names {rel!r}, which this sdist does not have")
        lines = path.read_text().split("\n")
        shift = 0
        for hunk in hunks:
            start = int(_HUNK.match(hunk[0]).group(1)) - 1
            body = [h for h in hunk[1:] if not h.startswith("\\")]
            old = [h[1:] if h else "" for h in body if not h.startswith("+")]
            new = [h[1:] if h else "" for h in body if not h.startswith("-")]
            at = _find(lines, old, start + shift)
            if at is None:
                raise SystemExit(f"ftimage: patch {name} does not apply to {rel} (hunk {hunk[0]})")
            lines[at:at + len(old)] = new
            shift = at - start + len(new) - len(old)
        path.write_text("\n".join(lines))


def _find(lines: list[str], block: list[str], near: int) -> int | None:
    for distance in range(0, len(lines) + 1):
        for at in (near - distance, near + distance):
            if 0 <= at <= len(lines) - len(block) and lines[at:at + len(block)] == block:
                return at
    return None


def apply_patches(src: Path, patches: Path) -> None:
    for patch in sorted(patches.glob("*.patch")):
        say(f"applying {patch.name}")
        apply_unified_diff(src, patch.read_text(), patch.name)


def install_build_requires(wheels: Path) -> None:
    """The kernel's own build requirements, on top of a builder image that holds only the
    toolchain: hash-locked wheels from `wheels/requirements.txt`, offline. One toolchain image
    then serves every kernel, and each compile still sees exactly its pinned requirements."""
    say(f"installing the build requirements: {', '.join(sorted(w.name for w in wheels.glob('*.whl')))}")
    code = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--no-cache-dir", "--disable-pip-version-check", "--require-hashes", "--find-links",
                           str(wheels), "-r", str(wheels / "requirements.txt")]).returncode
    if code != 0:
        raise SystemExit(f"ftimage: installing the build requirements failed (exit {code})")


def build_wheel(src: Path, out: Path, env: dict[str, str]) -> Path:
    """pip wheel, verbose so that the compiler output (and ninja's progress) streams through."""
    dist = out / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-index", "--no-deps", "--no-build-isolation",
           "--no-cache-dir", "--disable-pip-version-check", "--wheel-dir", str(dist), "."]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"ftimage: the wheel build failed (exit {code})")
    wheels = sorted(dist.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"ftimage: the build produced {len(wheels)} wheels, expected 1")
    say(f"compiled in {time.monotonic() - started:.0f}s")
    return wheels[0]


def cuda_home(env: dict[str, str]) -> str | None:
    """CUDA_HOME, found the way a toolkit is laid out: torch guesses it from `which nvcc`, which
    is wrong when nvcc is a symlink in /usr/local/bin (it then looks for headers under
    /usr/local/include). Follow the link to the toolkit's own bin/ instead."""
    if env.get("CUDA_HOME"):
        return env["CUDA_HOME"]
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    candidates = [Path(os.path.realpath(nvcc)).parent.parent] if nvcc else []
    if nvcc and os.path.getsize(nvcc) < 4096:  # a wrapper script: `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
        try:
            target = re.search(r"exec\s+(\S+)/bin/nvcc\b", Path(nvcc).read_text(errors="replace"))
        except OSError:
            target = None
        if target:
            candidates.insert(0, Path(target.group(1)))
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime_api.h").is_file():
            return str(home)
    return None


def observe() -> dict[str, str]:
    """What the wheel was really built with, for the version checks."""
    import torch

    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release (\d+\.\d+)", text)
    except OSError:
        release = None
    cc = os.environ.get("CC") or "gcc"
    try:
        gcc = subprocess.run([cc, "-dumpversion"], capture_output=True, text=True).stdout.strip()
    except OSError:
        gcc = "?"
    return {"torch": torch.__version__, "torch_cuda": str(torch.version.cuda), "nvcc": release.group(1) if release
            else "?", "compiler": f"gcc-{gcc.split('.')[0]}", "compiler_version": gcc,
            "python": ".".join(map(str, sys.version_info[:3])), "cxx11_abi": str(torch.compiled_with_cxx11_abi())}


def check(wheel: Path, work: Path, config: str, check_script: Path) -> int:
    """Import/ABI and entry-point checks against the installed torch, from a throwaway target
    so the environment itself stays unchanged."""
    target = work / "checked"
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir",
                    "--disable-pip-version-check", "--target", str(target), str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(target) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # run from an empty folder, so the unpacked sources cannot shadow the installed wheel
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, str(check_script), config], cwd=empty, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sdist", type=Path, required=True)
    p.add_argument("--patches", type=Path, required=True, help="folder of NN-name.patch files, applied in order")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True, help="scratch folder (the unpacked sources)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="build knob (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="parallel compile jobs (MAX_JOBS)")
    p.add_argument("--ccache", type=Path, help="ccache folder in front of nvcc")
    p.add_argument("--check-config", help="JSON for the check script; omit to skip the checks")
    p.add_argument("--check-script", type=Path, default=Path(__file__).with_name("incontainer_check.py"))
    p.add_argument("--build-requires", type=Path,
                   help="folder of hash-locked wheels (and their requirements.txt) to install before compiling")
    args = p.parse_args(argv)

    env = dict(os.environ)
    knob_names = {"MAX_JOBS"}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not SAFE_ENV.fullmatch(key):
            raise SystemExit(f"ftimage: bad --env {item!r}")
        env[key] = value
        knob_names.add(key)
    env.update({"MAX_JOBS": str(max(1, args.jobs)), "NVCC_THREADS": "1", "NINJA_STATUS": NINJA_STATUS,
                "PIP_NO_INPUT": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    if args.ccache and shutil.which("ccache"):
        env.update({"CCACHE_DIR": str(args.ccache), "CCACHE_MAXSIZE": "5G",
                    "PYTORCH_NVCC": f"ccache {os.path.join(env.get('CUDA_HOME', '/usr/local/cuda'), 'bin', 'nvcc')}"})
    home = cuda_home(env)
    if home:
        env["CUDA_HOME"] = home
        env["PATH"] = os.pathsep.join([os.path.join(home, "bin"), env.get("PATH", "")])
    args.out.mkdir(parents=True, exist_ok=True)
    if args.build_requires:
        install_build_requires(args.build_requires)
    src = unpack(args.sdist, args.work / "src")
    apply_patches(src, args.patches)
    knobs = " ".join(f"{k}={env[k]}" for k in sorted(knob_names))
    say(f"compiling {args.sdist.name} with {knobs}")
    wheel = build_wheel(src, args.out, env)
    (args.out / "observed.json").write_text(json.dumps(observe(), sort_keys=True))
    if args.check_config:
        return check(wheel, args.work, args.check_config, args.check_script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
