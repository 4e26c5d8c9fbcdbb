"""Which GPU archs a compiled wheel really holds, read from the ELF `.nv_fatbin` sections.

GPU-free and dependency-light (pyelftools): the same facts `cuobjdump --list-elf/--list-ptx`
prints, which /usr/local/cuda here lacks. Fatbin layout: a 16-byte header (magic
0xBA55ED50, version, header size, payload size) followed by entries, each with its own
header: kind (1 = PTX, 2 = ELF/SASS), header size, payload size, and the sm number at
byte 28.
"""
from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


@dataclass(frozen=True)
class ArchReport:
    sass: tuple[str, ...]      # e.g. ("sm_90",)
    ptx: tuple[str, ...]
    shared_objects: tuple[str, ...]

    def missing(self, wanted: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a for a in wanted if a not in self.sass)

    def extra(self, wanted: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a for a in self.sass if a not in wanted)


def parse_fatbin(blob: bytes) -> tuple[set[int], set[int]]:
    """Return (sass sm numbers, ptx sm numbers) found in one `.nv_fatbin` section."""
    sass, ptx = set(), set()
    offset = 0
    while offset + 16 <= len(blob):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", blob, offset)
        if magic != FATBIN_MAGIC:
            offset += 8  # sections are 8-byte aligned; skip padding between fatbins
            continue
        entry = offset + header_size
        end = min(entry + fat_size, len(blob))
        while entry + 32 <= end:
            kind, _unk, entry_header, payload = struct.unpack_from("<HHIQ", blob, entry)
            arch = struct.unpack_from("<I", blob, entry + 28)[0]
            if entry_header == 0:
                break
            if kind == KIND_ELF:
                sass.add(arch)
            elif kind == KIND_PTX:
                ptx.add(arch)
            entry += entry_header + payload
        offset = end
    return sass, ptx


def archs_of_shared_object(data: bytes) -> tuple[set[int], set[int]]:
    try:
        elf = ELFFile(io.BytesIO(data))
    except ELFError:
        return set(), set()
    sass, ptx = set(), set()
    for section in elf.iter_sections():
        if section.name == ".nv_fatbin":
            s, p = parse_fatbin(section.data())
            sass |= s
            ptx |= p
    return sass, ptx


def archs_of_wheel(wheel: Path) -> ArchReport:
    sass, ptx, objects = set(), set(), []
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith(".so") or ".so." in name.rsplit("/", 1)[-1]:
                s, p = archs_of_shared_object(zf.read(name))
                objects.append(name)
                sass |= s
                ptx |= p
    fmt = lambda nums: tuple(f"sm_{n}" for n in sorted(nums))  # noqa: E731
    return ArchReport(sass=fmt(sass), ptx=fmt(ptx), shared_objects=tuple(sorted(objects)))
