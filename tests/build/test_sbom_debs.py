"""The SBOM names every Debian package of the runtime base, read from its dpkg database (never by
running the base), and a crafted dpkg database cannot put arbitrary text into a package URL."""
from __future__ import annotations

import json

import pytest

from build import pipeline
from build.base.bootstrap import base_tag
from build.context.dpkg_status import DPKG_STATUS, DebPackage, parse_dpkg_status
from tests.build.test_pipeline_logic import QUIET, engine_with_bases, smoke  # noqa: F401 (fixture)

pytestmark = pytest.mark.unit

STATUS = """Package: libc6
Status: install ok installed
Priority: optional
Architecture: amd64
Version: 2.36-9+deb12u10
Description: GNU C Library: Shared libraries
 Contains the standard libraries that are used by nearly all programs on
 the system.

Package: python3.11-minimal
Status: install ok installed
Architecture: amd64
Source: python3.11
Version: 3.11.2-6+deb12u6
Conffiles:
 /etc/python3.11/sitecustomize.py 123

Package: removed-one
Status: deinstall ok config-files
Architecture: amd64
Version: 1.0

Package: Evil Name"><script>
Status: install ok installed
Architecture: amd64
Version: 1.0

Package: tzdata
Status: install ok installed
Architecture: all
Version: 1:2024a-0+deb12u1?arch=x86
"""


def test_installed_packages_only_with_policy_shaped_fields():
    assert parse_dpkg_status(STATUS) == (DebPackage("libc6", "2.36-9+deb12u10", "amd64"),
                                         DebPackage("python3.11-minimal", "3.11.2-6+deb12u6", "amd64"))
    assert DebPackage("libc6", "2.36-9+deb12u10", "amd64").purl == "pkg:deb/debian/libc6@2.36-9+deb12u10?arch=amd64"
    assert parse_dpkg_status("") == () and parse_dpkg_status("garbage\n\n\x00") == ()


def test_the_sbom_lists_the_runtime_bases_packages(smoke):  # noqa: F811
    plan, cache, out = smoke
    engine = engine_with_bases(plan)
    engine.files[(base_tag(plan.spec.runtime_base.bootstrap), DPKG_STATUS)] = STATUS.encode()
    pipeline.build_image(plan, builder="dockerfile", cache=cache, out_dir=out, log=QUIET, engine=engine)
    sbom = json.loads((out / "sbom.cdx.json").read_text())
    debs = {c["purl"] for c in sbom["components"] if c.get("purl", "").startswith("pkg:deb/")}
    assert debs == {"pkg:deb/debian/libc6@2.36-9%2Bdeb12u10?arch=amd64",
                    "pkg:deb/debian/python3.11-minimal@3.11.2-6%2Bdeb12u6?arch=amd64"}
    # every component hangs off the image in the dependency graph
    root = sbom["metadata"]["component"]["bom-ref"]
    listed = set(next(d for d in sbom["dependencies"] if d["ref"] == root)["dependsOn"])
    assert {c["bom-ref"] for c in sbom["components"]} <= listed
