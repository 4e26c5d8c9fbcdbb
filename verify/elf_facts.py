"""What a compiled extension (.so) says about itself, read with the standard library only:
the GPU archs in its `.nv_fatbin` (SASS and PTX), the libraries it needs (DT_NEEDED, e.g.
libcudart.so.12) and the symbols it expects torch to provide (its undefined dynamic symbols,
whose mangling shows the C++ ABI it was compiled with).

The build host reads the same fatbin format out of wheels with pyelftools
(build/kernels/archs.py); this copy runs inside any image (verify imports nothing of build/,
and an image need not have pyelftools), and seeks through the file instead of reading it, so
a 500 MB flash-attn extension costs a few reads. ELF64 little-endian only (x86_64, aarch64).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
SHT_DYNSYM, SHT_DYNAMIC = 11, 6
DT_NEEDED = 1
MAX_ENTRIES = 100_000        # a hostile or damaged file cannot keep the reader busy


class NotElf(Exception):
    pass


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class ElfFacts:
    sass: tuple[int, ...]          # sm numbers with SASS, e.g. (80, 90)
    ptx: tuple[int, ...]           # sm numbers with PTX
    needed: tuple[str, ...]        # DT_NEEDED, e.g. ("libc10.so", "libcudart.so.12")
    undefined: tuple[str, ...]     # undefined dynamic symbols (what it expects to be given)

    @property
    def has_device_code(self) -> bool:
        return bool(self.sass or self.ptx)


def _sections(fh: BinaryIO) -> list[Section]:
    head = fh.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF":
        raise NotElf("not an ELF file")
    if head[4] != 2 or head[5] != 1:
        raise NotElf("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
    if shentsize < 64 or shnum > MAX_ENTRIES or shstrndx >= max(shnum, 1):
        raise NotElf("damaged ELF section table")
    raw = []
    for i in range(shnum):
        fh.seek(shoff + i * shentsize)
        data = fh.read(64)
        if len(data) < 64:
            raise NotElf("truncated ELF section table")
        name, typ, _flags, _addr, offset, size, link, _info, _align, entsize = struct.unpack("<IIQQQQIIQQ", data)
        raw.append((name, typ, offset, size, link, entsize))
    names_offset, names_size = raw[shstrndx][2], raw[shstrndx][3]
    fh.seek(names_offset)
    names = fh.read(min(names_size, 1 << 20))
    return [Section(_cstr(names, n), t, o, s, lk, e) for n, t, o, s, lk, e in raw]


def _cstr(blob: bytes, offset: int) -> str:
    if offset >= len(blob):
        return ""
    end = blob.find(b"\0", offset)
    return blob[offset:end if end >= 0 else len(blob)].decode("utf-8", "replace")


def fatbin_archs(fh: BinaryIO, offset: int, size: int) -> tuple[set[int], set[int]]:
    """(SASS sm numbers, PTX sm numbers) of one `.nv_fatbin` section, by seeking from header to
    header: a 16-byte fatbin header (magic, version, header size, payload size), then entries,
    each with its kind (1 PTX, 2 ELF/SASS), header size, payload size, and the sm at byte 28."""
    sass, ptx = set(), set()
    pos, end, seen = offset, offset + size, 0
    while pos + 16 <= end and seen < MAX_ENTRIES:
        fh.seek(pos)
        head = fh.read(16)
        if len(head) < 16:
            break
        magic, _version, header_size, fat_size = struct.unpack("<IHHQ", head)
        if magic != FATBIN_MAGIC:
            pos += 8   # fatbins are 8-byte aligned; skip the padding between them
            continue
        entry, stop = pos + header_size, min(pos + header_size + fat_size, end)
        while entry + 32 <= stop and seen < MAX_ENTRIES:
            seen += 1
            fh.seek(entry)
            blob = fh.read(32)
            if len(blob) < 32:
                break
            kind, _unk, entry_header, payload = struct.unpack_from("<HHIQ", blob)
            arch, = struct.unpack_from("<I", blob, 28)
            if entry_header == 0:
                break
            (sass if kind == KIND_ELF else ptx if kind == KIND_PTX else set()).add(arch)
            entry += entry_header + payload
        pos = max(stop, pos + 16)
    return sass, ptx


def _strings_of(fh: BinaryIO, section: Section) -> bytes:
    fh.seek(section.offset)
    return fh.read(min(section.size, 64 << 20))


def read_facts(path: str | Path) -> ElfFacts:
    """Raises NotElf for a file that is not a (readable) ELF64 LE shared object."""
    with open(path, "rb") as fh:
        sections = _sections(fh)
        sass: set[int] = set()
        ptx: set[int] = set()
        needed: list[str] = []
        undefined: list[str] = []
        for sec in sections:
            if sec.name == ".nv_fatbin":
                s, p = fatbin_archs(fh, sec.offset, sec.size)
                sass |= s
                ptx |= p
            elif sec.type == SHT_DYNAMIC and sec.link < len(sections):
                strings = _strings_of(fh, sections[sec.link])
                fh.seek(sec.offset)
                data = fh.read(min(sec.size, 16 * MAX_ENTRIES))
                for i in range(0, len(data) - 15, 16):
                    tag, value = struct.unpack_from("<qQ", data, i)
                    if tag == 0:
                        break
                    if tag == DT_NEEDED:
                        needed.append(_cstr(strings, value))
            elif sec.type == SHT_DYNSYM and sec.link < len(sections):
                strings = _strings_of(fh, sections[sec.link])
                fh.seek(sec.offset)
                data = fh.read(min(sec.size, 24 * MAX_ENTRIES))
                for i in range(24, len(data) - 23, 24):   # entry 0 is the null symbol
                    name, _info, _other, shndx = struct.unpack_from("<IBBH", data, i)
                    if shndx == 0 and name:
                        undefined.append(_cstr(strings, name))
    return ElfFacts(tuple(sorted(sass)), tuple(sorted(ptx)), tuple(needed), tuple(undefined))


# std::string in a mangled name: `NSt7__cxx1112basic_string...` with the C++11 ABI, `Ss` without.
_OLD_ABI_STRING = re.compile(r"(?:RK|PK|K|R|P)Ss")
_TORCH_SYMBOL = re.compile(r"^_ZN?K?(?:3c10|2at|5torch)")


def cxx11_abi_of(undefined: tuple[str, ...]) -> bool | None:
    """The _GLIBCXX_USE_CXX11_ABI the extension was compiled with, judged from the torch/c10
    symbols it expects: True (C++11 std::string), False (the old one), None (cannot tell)."""
    torch_symbols = [s for s in undefined if _TORCH_SYMBOL.match(s)]
    if any("__cxx11" in s for s in torch_symbols):
        return True
    if any(_OLD_ABI_STRING.search(s) for s in torch_symbols):
        return False
    return None


def cuda_runtime_major(needed: tuple[str, ...]) -> int | None:
    """The CUDA major version the extension links its runtime for (libcudart.so.12 -> 12)."""
    for lib in needed:
        match = re.fullmatch(r"libcudart\.so\.(\d+)(?:\.\d+)*", lib)
        if match:
            return int(match.group(1))
    return None
