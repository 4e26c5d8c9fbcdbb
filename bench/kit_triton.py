"""A trimmed Triton that travels with the GPU proof kit.

fla-core refuses its gated-delta backward on Hopper with Triton older than 3.7.1 (wrong gradients
upstream), and reads `triton.__version__` at import. A GPU host with an older Triton therefore
needs a newer one for the proof, and the whole wheel (198 MB) cannot travel with the kit. The
sm_90 subset can: the Python package and libtriton (stripped of symbols, xz-compressed), without
the binaries the host's own Triton already has byte for byte (ptxas, nvdisasm, cuobjdump; their
sha256 is in the manifest and checked against the host's before use), the profiler's CUPTI
libraries, AMD's backend and test plugins.

    prepare(KIT)   on a machine with PyPI: download, trim, compress, write KIT/triton/manifest.json
    stage(KIT, DIR, host_python)   on the GPU host: check every sha256, unpack into DIR (idempotent),
                                   point the trimmed Triton at the host's ptxas

DIR goes first on PYTHONPATH for the kit's processes (the image's isolated mode drops PYTHONPATH,
which is why the kit runs the project's code without -I).
"""
from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from contracts.errors import FixableError

VERSION = "3.7.1"
WHEEL_PYTHON = "3.12"
DROP_PREFIXES = ("triton/backends/nvidia/bin/", "triton/backends/nvidia/lib/cupti/", "triton/backends/amd/",
                 "triton/instrumentation/", "triton/plugins/", "triton/FileCheck")
HOST_REUSED = ("triton/backends/nvidia/bin/ptxas",)   # must equal the host's, byte for byte
STRIP = ("triton/_C/libtriton.so", "triton/_C/libproton.so")
PAYLOAD = "triton.tar.xz"


class KitTritonError(FixableError):
    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def prepare(kit: Path) -> dict:
    """Download triton==VERSION for the GPU host's Python, trim, strip, compress; write the manifest."""
    out = kit / "triton"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kit-triton-") as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", WHEEL_PYTHON, "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_27_x86_64", f"triton=={VERSION}", "-d", str(tmp / "dl")],
                       check=True)
        wheel = next((tmp / "dl").glob("triton-*.whl"))
        tree = tmp / "tree"
        reused = {}
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name in HOST_REUSED:
                    reused[name] = hashlib.sha256(zf.read(name)).hexdigest()
                if name.endswith("/") or name.startswith(DROP_PREFIXES):
                    continue
                zf.extract(name, tree)
        for name in STRIP:
            subprocess.run(["strip", "--strip-unneeded", str(tree / name)], check=True)
        files = {str(p.relative_to(tree)): sha256(p) for p in sorted(tree.rglob("*")) if p.is_file()}
        with lzma.open(out / PAYLOAD, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            for rel in files:
                info = tar.gettarinfo(str(tree / rel), arcname=rel)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                with open(tree / rel, "rb") as fh:
                    tar.addfile(info, fh)
    manifest = {"version": VERSION, "python": WHEEL_PYTHON, "wheel": wheel.name, "payload": PAYLOAD,
                "payload_sha256": sha256(out / PAYLOAD), "files": files, "host_reused": reused}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def host_triton_dir(python: str) -> Path | None:
    """The host's own installed Triton package folder (to reuse its ptxas)."""
    proc = subprocess.run([python, "-c", "import importlib.util as u; s = u.find_spec('triton'); "
                           "print(s.submodule_search_locations[0] if s else '')"], capture_output=True, text=True)
    text = proc.stdout.strip()
    return Path(text) if proc.returncode == 0 and text else None


def stage(kit: Path, dest: Path, python: str) -> dict:
    """Unpack the checked payload into dest (a folder for PYTHONPATH); returns the env to add.
    KitTritonError when the payload or the host's ptxas is not what the manifest says."""
    manifest_path = kit / "triton" / "manifest.json"
    if not manifest_path.is_file():
        raise KitTritonError(f"no Triton payload in {kit}/triton", "run `python3 bench/gpu_proof.py --prepare` on a "
                             "machine with network, and carry .kit with the working tree")
    manifest = json.loads(manifest_path.read_text())
    payload = kit / "triton" / manifest["payload"]
    if not payload.is_file() or sha256(payload) != manifest["payload_sha256"]:
        raise KitTritonError(f"{payload} does not match its sha256 in {manifest_path}",
                             "prepare the payload again (--prepare); never edit .kit by hand")
    host = host_triton_dir(python)
    ptxas = host / "backends" / "nvidia" / "bin" / "ptxas" if host else None
    want = manifest["host_reused"].get("triton/backends/nvidia/bin/ptxas")
    if ptxas is None or not ptxas.is_file():
        raise KitTritonError("this host has no Triton ptxas to reuse",
                             f"install the Triton that torch pins here, or carry the full triton {VERSION} wheel")
    if sha256(ptxas) != want:
        raise KitTritonError(f"this host's ptxas ({ptxas}) differs from triton {VERSION}'s (sha256 {want[:12]}...)",
                             f"carry triton {VERSION}'s own ptxas, or use a host whose Triton ships the same one")
    marker = dest / ".staged.json"
    if marker.is_file() and json.loads(marker.read_text()).get("payload_sha256") == manifest["payload_sha256"]:
        return _env(dest, ptxas)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with lzma.open(payload) as xz, tarfile.open(fileobj=xz) as tar:
        tar.extractall(dest, filter="data")
    for rel, digest in manifest["files"].items():
        if sha256(dest / rel) != digest:
            raise KitTritonError(f"{dest / rel} does not match the manifest after unpacking",
                                 "free disk space under the kit's work folder and run the kit again")
    marker.write_text(json.dumps({"payload_sha256": manifest["payload_sha256"]}))
    return _env(dest, ptxas)


def _env(dest: Path, ptxas: Path) -> dict:
    return {"TRITON_PTXAS_PATH": str(ptxas), "FTIMAGE_KIT_TRITON": str(dest)}


if __name__ == "__main__":
    print(json.dumps(prepare(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".kit")), indent=1)[:2000])
