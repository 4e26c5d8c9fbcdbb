"""`pip check` over a staged site-packages, without pip and without importing anything from it.

Every installed distribution's Requires-Dist (markers evaluated for the image's interpreter
and platform, extras not requested) must be met by an installed version. A lock that misses a
dependency, or pins two that disagree, fails the build here instead of at `import` in a job.
"""
from __future__ import annotations

import email.parser
from pathlib import Path

from packaging.markers import InvalidMarker, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


def target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values for CPython `python_version` (e.g. 3.11.2) on Linux x86_64."""
    major_minor = ".".join(python_version.split(".")[:2])
    return {"implementation_name": "cpython", "implementation_version": python_version, "os_name": "posix",
            "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": python_version,
            "python_version": major_minor, "sys_platform": "linux", "extra": ""}


def installed(site_packages: Path) -> dict[str, tuple[str, list[str]]]:
    """canonical name -> (version, Requires-Dist lines) for each dist-info."""
    found = {}
    for metadata in sorted(site_packages.glob("*.dist-info/METADATA")):
        message = email.parser.Parser().parsestr(metadata.read_text(encoding="utf-8", errors="replace"),
                                                 headersonly=True)
        name, version = message.get("Name", ""), message.get("Version", "")
        if name:
            found[canonicalize_name(name)] = (version, message.get_all("Requires-Dist") or [])
    return found


def dependency_problems(site_packages: Path, python_version: str) -> list[str]:
    env = target_environment(python_version)
    dists = installed(site_packages)
    problems = []
    for name, (version, requires) in sorted(dists.items()):
        for line in requires:
            try:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
            except (InvalidRequirement, InvalidMarker, UndefinedEnvironmentName) as exc:
                problems.append(f"{name} {version}: cannot read its requirement {line!r} ({exc})")
                continue
            have = dists.get(canonicalize_name(req.name))
            if have is None:
                problems.append(f"{name} {version} requires {req}, which is not installed")
                continue
            try:
                ok = req.specifier.contains(Version(have[0]), prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                problems.append(f"{name} {version} requires {req}, but {req.name} {have[0]} is installed")
    return problems
