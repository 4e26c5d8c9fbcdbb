"""Kernel wheels and cache entries as a compile makes them, for tests: a real zip holding a
shared object whose `.nv_fatbin` section carries SASS and PTX for the archs asked (read back by
build/kernels/archs.py, as a compiled wheel is), a dist-info (WHEEL with its tags, METADATA),
and the meta.json build/kernels/compile.py writes. Each part can be made to disagree with the
others, or with the key's inputs."""
from __future__ import annotations

import base64
import hashlib
import json
import struct
import zipfile
from pathlib import Path

from build.kernels.acceptance import Expected
from build.kernels.store import KernelEntry, KernelStore
from build.resolve import digest

TORCH = "2.14.1"          # the toolchain of images/kernel-smoke: cu130-torch2.14.1-py311
OBSERVED = {"torch": "2.14.1+cu130", "torch_cuda": "13.0", "nvcc": "13.0", "compiler": "gcc-12",
            "compiler_version": "12.2.0", "python": "3.11.2", "cxx11_abi": "True"}
BUILD_LOG = b"compiled\n"


def fatbin(sass, ptx) -> bytes:
    """One fatbin: its header, then an entry per arch (kind 2 = SASS, 1 = PTX) with an 8-byte payload."""
    body = b""
    for kind, archs in ((2, sass), (1, ptx)):
        for arch in archs:
            header = struct.pack("<HHIQ", kind, 0, 64, 8) + b"\0" * 12 + struct.pack("<I", int(arch[3:])) + \
                b"\0" * 32
            body += header + b"\xaa" * 8
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def shared_object(sass, ptx) -> bytes:
    """A minimal ELF64 shared object with a .shstrtab and a .nv_fatbin section."""
    names = [b"", b".shstrtab", b".nv_fatbin"]
    shstrtab = b"\0".join(names) + b"\0"
    blobs = [b"", shstrtab, fatbin(sass, ptx)]
    data, placed = b"", []
    for blob in blobs:
        placed.append(64 + len(data))
        data += blob + b"\0" * (-len(blob) % 8)
    shoff = 64 + len(data)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\0" * 8
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(blobs), 1)
    offsets = [shstrtab.index(n + b"\0") if n else 0 for n in names]
    sections = b"".join(struct.pack("<IIQQQQIIQQ", offsets[i], [0, 3, 1][i], 0, 0, placed[i] if i else 0,
                                    len(blobs[i]), 0, 0, 8, 0) for i in range(len(blobs)))
    return header + data + sections


def wheel_name(kernel: str, version: str, tag: str = "cp311-cp311-linux_x86_64") -> str:
    return f"{kernel.replace('-', '_')}-{version}-{tag}.whl"


def write_wheel(folder: Path, kernel: str, version: str, *, sass=("sm_90",), ptx=(),
                tag: str = "cp311-cp311-linux_x86_64", held_tag: str | None = None,
                held_version: str | None = None, payload: bytes = b"kernel", name: str | None = None) -> Path:
    """A compiled kernel's wheel: `tag` in its file name, `held_tag` / `held_version` in its
    dist-info (the file name's unless given)."""
    dist = kernel.replace("-", "_")
    path = folder / (name or wheel_name(kernel, version, tag))
    info = f"{dist}-{version}.dist-info"
    files = {f"{dist}/__init__.py": payload, f"{dist}/_C.cpython-311-x86_64-linux-gnu.so": shared_object(sass, ptx),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {held_version or version}\n".encode(),
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: "
                              f"{held_tag or tag}\n".encode()}
    record = "".join(f"{member},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for member, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()    # pip installs it
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return path


def key_inputs(kernel: str = "causal-conv1d", version: str = "1.7.0", archs=("sm_90",), **more) -> dict:
    """A compiled kernel's key inputs, with every field the acceptance reads."""
    return {"kernel": kernel, "version": version, "kind": "cuda-extension", "archs": list(archs),
            "sources": ["0" * 64], "python": "3.11", "platform": "linux_x86_64", "cuda": "13.0",
            "compiler": "gcc-12", "cxx11_abi": True, "torch_wheel_sha256": "5" * 64, **more}


def entry_meta(inputs: dict, wheel: Path, *, sass=None, ptx=(), observed: dict | None = None) -> dict:
    """meta.json as compile.py writes it (less the key, which KernelStore.publish adds)."""
    return {"kernel": inputs["kernel"], "version": inputs["version"], "wheel": wheel.name, "inputs": inputs,
            "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(), "observed": dict(observed or OBSERVED),
            "archs": {"sass": list(inputs["archs"] if sass is None else sass), "ptx": list(ptx)},
            "build_log_sha256": hashlib.sha256(BUILD_LOG).hexdigest(), "duration_s": 600.0, "created": 1}


def publish(store: KernelStore, inputs: dict, *, payload: bytes = b"kernel") -> KernelEntry:
    """A sound entry for `inputs`, published into `store` as a compile publishes it."""
    key = digest(inputs)
    with store.lock(key):
        staging = store.staging(key)
        wheel = write_wheel(staging, inputs["kernel"], inputs["version"], sass=inputs["archs"], payload=payload)
        (staging / "build.log").write_bytes(BUILD_LOG)
        return store.publish(key, staging, entry_meta(inputs, wheel))


def write_entry(directory: Path, inputs: dict, **wheel) -> Path:
    """A sound entry folder for `inputs` (as `kernels export` writes one); returns it."""
    directory.mkdir(parents=True)
    path = write_wheel(directory, inputs["kernel"], inputs["version"], sass=inputs["archs"], **wheel)
    (directory / "build.log").write_bytes(BUILD_LOG)
    meta = {**entry_meta(inputs, path), "key": digest(inputs)}
    (directory / "meta.json").write_text(json.dumps(meta, sort_keys=True))
    return directory


def expected(inputs: dict, torch: str | None = TORCH) -> Expected:
    return Expected(digest(inputs), inputs, torch)
