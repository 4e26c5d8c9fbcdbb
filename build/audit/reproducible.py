"""`python -m build verify-reproducible IMAGE_DIR`: build the image twice and prove both builds
give the same image.

Each build runs from its own fresh clone of HEAD, with its own fresh cache and output folder
(`--kernels-from` and `--inputs-from` may seed both caches with the same compiled kernels and
downloads, which are kept by content; the resolution, the base, the layers and the image are
still made twice).
The second one also runs under umask 077, another time zone and, where this process may
create a UTS namespace (root with `unshare`), another host name. Compared: the image ID, every
layer's diffID, the manifest digest, the lock's sha256 and, with `--push-to`, the digest the
registry stores for each. On a mismatch the first differing layer is opened and its first
differing paths are shown (with diffoscope's report too, when it is installed); exit 1.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from build.errors import BuildFailure
from build.oci.image import read_layout
from build.publish.reference import PushTarget
from build.publish.registry import LayoutPushClient, Registry
from build.spec import REPO_ROOT
from contracts import folder_guard
from contracts.schema import InvalidInput, Problem

SECOND_BUILD_TZ = "Pacific/Kiritimati"
SECOND_BUILD_HOSTNAME = "reproducibility-check"
SHOWN_PATHS = 10
# what a build copies from the checkout: the app packages, the image and base specs, the patches
BUILD_COPIES = ("contracts", "families", "verify", "guard", "entrypoint", "images", "build/patches",
                "kernels_manifest.yaml")


class ReproducibleArgs(InvalidInput):
    title = "verify-reproducible's arguments"


@dataclass
class BuildResult:
    label: str
    conditions: str
    image_id: str = ""
    manifest_digest: str = ""
    diff_ids: list[str] = field(default_factory=list)
    lock_sha256: str = ""
    base_rootfs: str = ""       # the runtime base's diffIDs, as the lock records them
    pushed_digest: str = ""
    layout: str = ""
    seconds: float = 0.0


@dataclass
class Comparison:
    same: bool
    rows: list[tuple[str, str, str, bool]]
    first_differing_layer: int | None = None
    differing_paths: list[str] = field(default_factory=list)
    diffoscope: str = ""

    def render(self, a: BuildResult, b: BuildResult) -> str:
        lines = [f"build A: {a.conditions}", f"build B: {b.conditions}", "",
                 f"{'WHAT':<22} {'SAME':<5} {'BUILD A':<28} BUILD B"]
        lines += [f"{what:<22} {'yes' if same else 'NO':<5} {va[:28]:<28} {vb[:28]}"
                  for what, va, vb, same in self.rows]
        if self.first_differing_layer is not None:
            lines += ["", f"layer {self.first_differing_layer + 1} differs; first differing paths:"]
            lines += [f"  {p}" for p in self.differing_paths] or \
                ["  (same entries: the difference is in the tar framing)"]
        if self.diffoscope:
            lines += ["", "diffoscope:", self.diffoscope]
        lines += ["", "REPRODUCIBLE" if self.same else "NOT REPRODUCIBLE"]
        return "\n".join(lines)


def compare(a: BuildResult, b: BuildResult) -> Comparison:
    rows = [("image ID", a.image_id, b.image_id, a.image_id == b.image_id),
            ("manifest digest", a.manifest_digest, b.manifest_digest, a.manifest_digest == b.manifest_digest),
            ("lock sha256", a.lock_sha256, b.lock_sha256, a.lock_sha256 == b.lock_sha256),
            ("base rootfs", a.base_rootfs, b.base_rootfs, a.base_rootfs == b.base_rootfs),
            ("layer count", str(len(a.diff_ids)), str(len(b.diff_ids)), len(a.diff_ids) == len(b.diff_ids))]
    for i, (da, db) in enumerate(zip(a.diff_ids, b.diff_ids)):
        rows.append((f"layer {i + 1} diffID", da, db, da == db))
    if a.pushed_digest or b.pushed_digest:
        rows.append(("pushed digest", a.pushed_digest, b.pushed_digest, a.pushed_digest == b.pushed_digest))
    result = Comparison(same=all(row[3] for row in rows) and bool(a.image_id), rows=rows)
    differing = next((i for i, (da, db) in enumerate(zip(a.diff_ids, b.diff_ids)) if da != db), None)
    if differing is not None and a.layout and b.layout:
        blob_a, blob_b = layer_blob(Path(a.layout), differing), layer_blob(Path(b.layout), differing)
        result.first_differing_layer = differing
        result.differing_paths = differing_paths(blob_a, blob_b)[:SHOWN_PATHS]
        result.diffoscope = run_diffoscope(blob_a, blob_b)
    return result


def layer_blob(layout: Path, index: int) -> Path:
    return read_layout(layout)[2][index]


def entries(blob: Path) -> dict[str, tuple]:
    """path -> (type, mode, uid, gid, mtime, size, link target, content sha256), streamed."""
    found = {}
    with tarfile.open(blob, mode="r|*") as tar:
        for member in tar:
            digest = ""
            if member.isreg():
                sha = hashlib.sha256()
                handle = tar.extractfile(member)
                while chunk := handle.read(1 << 20):
                    sha.update(chunk)
                digest = sha.hexdigest()[:16]
            found[member.name] = (member.type.decode(errors="replace"), oct(member.mode), member.uid, member.gid,
                                  member.mtime, member.size, member.linkname, digest)
    return found


FIELDS = ("type", "mode", "uid", "gid", "mtime", "size", "link", "content")


def differing_paths(blob_a: Path, blob_b: Path) -> list[str]:
    left, right = entries(blob_a), entries(blob_b)
    out = []
    for path in sorted(set(left) | set(right)):
        if path not in left or path not in right:
            out.append(f"{path}: only in build {'A' if path in left else 'B'}")
        elif left[path] != right[path]:
            what = [f"{name} {x} vs {y}" for name, x, y in zip(FIELDS, left[path], right[path]) if x != y]
            out.append(f"{path}: {', '.join(what)}")
    return out


def run_diffoscope(blob_a: Path, blob_b: Path) -> str:
    if shutil.which("diffoscope") is None:
        return ""
    try:
        out = subprocess.run(["diffoscope", "--text", "-", "--max-report-size", "200000", str(blob_a), str(blob_b)],
                             capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(diffoscope did not finish: {exc})"
    return "\n".join(out.stdout.splitlines()[:80])


# ---- the two builds -------------------------------------------------------------------------

def _clone(work: Path, name: str) -> Path:
    dest = work / name
    done = subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO_ROOT), str(dest)], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise BuildFailure(f"cannot clone {REPO_ROOT}: {done.stderr.strip()[:300]}",
                           "run verify-reproducible from a git checkout of this project")
    return dest


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-u", "true"], capture_output=True, timeout=30).returncode == 0


# Downloads the cache keeps by content (each file re-hashed against its pin when used): sharing
# them changes no byte of what is built, only skips fetching the same bytes twice.
DOWNLOADED_INPUTS = ("wheels", "sources", "debs")


def _share(source: Path, dest: Path) -> None:
    """Hard links where source and dest share a filesystem, a copy where they do not."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    linked = subprocess.run(["cp", "-al", str(source), str(dest)], capture_output=True, timeout=600)
    if linked.returncode != 0:
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run(["cp", "-a", str(source), str(dest)], check=True, capture_output=True, timeout=1200)


def _build(clone: Path, image_rel: str, work: Path, label: str, *, umask: int, tz: str, hostname: str | None,
           kernels_from: Path | None, inputs_from: Path | None, log_to) -> BuildResult:
    cache, out = work / f"cache-{label}", work / f"out-{label}"
    if kernels_from is not None or inputs_from is not None:   # a cache this tool made, before anything goes in
        folder_guard.claim(cache, folder_guard.CACHE_MARKER, what="cache folder", option="--work")
    if kernels_from is not None and (kernels_from / "kernels").is_dir():
        # compiled kernels are shared on purpose: nvcc's output is not the subject of this check
        _share(kernels_from / "kernels", cache / "kernels")
    for name in DOWNLOADED_INPUTS if inputs_from is not None else ():
        if (inputs_from / name).is_dir() and not (inputs_from / name).is_symlink():
            _share(inputs_from / name, cache / name)
    command = [sys.executable, "-m", "build", image_rel, "--cache", str(cache), "--out", str(out), "--json"]
    conditions = f"umask {umask:03o}, TZ={tz}"
    shell = f"umask {umask:03o}; exec \"$@\""
    argv = ["sh", "-c", shell, "sh", *command]
    if hostname:
        argv = ["unshare", "-u", "sh", "-c", f"hostname {hostname} && umask {umask:03o} && exec \"$@\"", "sh", *command]
        conditions += f", host name {hostname}"
    env = {k: v for k, v in os.environ.items() if k not in ("SOURCE_DATE_EPOCH", "FTIMAGE_CACHE")}
    env["TZ"] = tz
    print(f"verify-reproducible: build {label} ({conditions}) in {clone}", file=log_to, flush=True)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=log_to, text=True)
    if done.returncode != 0:
        raise BuildFailure(f"build {label} of {image_rel} failed (exit {done.returncode}); its log is above",
                           "fix the build first: `python -m build " + image_rel + "`")
    report = json.loads(done.stdout)
    lock = (out / "build.lock.json").read_bytes()
    return BuildResult(label=label, conditions=conditions, image_id=report["image_id"],
                       manifest_digest=report.get("manifest_digest", ""), diff_ids=report.get("diff_ids", []),
                       lock_sha256=hashlib.sha256(lock).hexdigest(), layout=report.get("layout", ""),
                       base_rootfs=json.loads(lock).get("base_images", {}).get("runtime.rootfs", ""),
                       seconds=round(time.monotonic() - started, 1))


def _push(result: BuildResult, target: PushTarget) -> None:
    client = LayoutPushClient(Path(result.layout), Registry(target.registry), target.path)
    for item in client.push(target.repository, f"repro-{result.label.lower()}"):
        if "error" in item:
            raise BuildFailure(f"pushing build {result.label} to {target.repository} failed: {item['error']}",
                               "check that the registry is up, or leave out --push-to")
        if (item.get("aux") or {}).get("Digest"):
            result.pushed_digest = item["aux"]["Digest"]


def untracked_build_inputs(repo: Path) -> list[str]:
    """Files a build of this checkout would copy that git does not track (and does not ignore):
    the clones the check builds from hold only HEAD, so these are left out of it."""
    out = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all", "--",
                          *BUILD_COPIES], capture_output=True, text=True).stdout
    return [line[3:] for line in out.splitlines() if line.startswith("?? ")]


def check_image_dir(image_dir: Path) -> Path:
    """The image folder, resolved; one outside this checkout, or with no image.yaml, is exit 2."""
    resolved = image_dir.resolve()
    if not resolved.is_relative_to(REPO_ROOT) or not (resolved / "image.yaml").is_file():
        raise ReproducibleArgs([Problem("verify-reproducible", "IMAGE_DIR", f"{image_dir} is not an image "
                                        f"folder of this checkout ({REPO_ROOT})",
                                        "name a folder under images/ that holds an image.yaml", "not-an-image")])
    return resolved


def note_what_is_left_out() -> None:
    """The clones hold only HEAD: say so when the checkout has more."""
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print("verify-reproducible: note: uncommitted changes are not part of the check; it builds HEAD",
              file=sys.stderr)
    untracked = untracked_build_inputs(REPO_ROOT)
    if untracked:
        shown = ", ".join(untracked[:SHOWN_PATHS]) + (f" and {len(untracked) - SHOWN_PATHS} more"
                                                     if len(untracked) > SHOWN_PATHS else "")
        print(f"verify-reproducible: note: {len(untracked)} untracked file(s) a build of this checkout would copy "
              f"are not part of the check (the clones hold only HEAD): {shown}", file=sys.stderr)


def verify_reproducible(image_dir: Path, *, work: Path | None = None, push_to: PushTarget | None = None,
                        kernels_from: Path | None = None,
                        inputs_from: Path | None = None) -> tuple[Comparison, list[BuildResult]]:
    """Build `image_dir` twice from two fresh clones of HEAD (another umask, time zone and host
    name for the second), push both when `push_to` is given, and compare them. `work`: where the
    clones, caches and outputs go; by default a temporary folder, removed afterwards."""
    image_dir = check_image_dir(image_dir)
    note_what_is_left_out()
    folder = work or Path(tempfile.mkdtemp(prefix="ftimage-repro-"))
    folder.mkdir(parents=True, exist_ok=True)
    rel = str(image_dir.relative_to(REPO_ROOT))
    try:
        results = []
        other_host = SECOND_BUILD_HOSTNAME if _can_unshare() else None
        for label, umask, tz, host in (("A", 0o022, "UTC", None), ("B", 0o077, SECOND_BUILD_TZ, other_host)):
            clone = _clone(folder, f"clone-{label}")
            results.append(_build(clone, rel, folder, label, umask=umask, tz=tz, hostname=host,
                                  kernels_from=kernels_from, inputs_from=inputs_from, log_to=sys.stderr))
        if push_to is not None:
            for result in results:
                _push(result, push_to)
        return compare(*results), results
    finally:
        if work is None:
            shutil.rmtree(folder, ignore_errors=True)
