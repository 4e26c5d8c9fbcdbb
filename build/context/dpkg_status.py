"""The Debian packages a base image holds, read from its dpkg database without running it, for
the SBOM (`pkg:deb/debian/NAME@VERSION?arch=ARCH`)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from build.engine import Engine

DPKG_STATUS = "/var/lib/dpkg/status"
STATUS_LIMIT = 32 << 20
# Debian policy's grammar for the fields the SBOM names; a stanza that breaks it is skipped, so a
# crafted base cannot put arbitrary text into a package URL
NAME = re.compile(r"[a-z0-9][a-z0-9+.-]+")
VERSION = re.compile(r"(?:[0-9]+:)?[0-9A-Za-z.+~-]+")
ARCH = re.compile(r"[a-z0-9-]+")


@dataclass(frozen=True, order=True)
class DebPackage:
    name: str
    version: str
    arch: str

    @property
    def purl(self) -> str:
        return f"pkg:deb/debian/{self.name}@{self.version}?arch={self.arch}"


def parse_dpkg_status(text: str) -> tuple[DebPackage, ...]:
    """Installed packages (Status: install ok installed), sorted, one per name and arch."""
    found = set()
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") or ":" not in line:
                continue   # continuation lines (descriptions, conffiles) name nothing the SBOM needs
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if fields.get("status", "").split()[-1:] != ["installed"]:
            continue
        name, version, arch = fields.get("package", ""), fields.get("version", ""), fields.get("architecture", "")
        if NAME.fullmatch(name) and VERSION.fullmatch(version) and ARCH.fullmatch(arch):
            found.add(DebPackage(name, version, arch))
    return tuple(sorted(found))


def base_packages(engine: Engine, image: str) -> tuple[DebPackage, ...]:
    data = engine.read_file(image, DPKG_STATUS, limit=STATUS_LIMIT)
    return parse_dpkg_status(data.decode("utf-8", errors="replace")) if data else ()
