"""CycloneDX SBOM of everything the image installs, generated from the lock (so it cannot drift)."""
from __future__ import annotations

import datetime
import uuid

from cyclonedx.model import HashAlgorithm, HashType, Property
from cyclonedx.model.bom import Bom
from cyclonedx.model.bom_ref import BomRef
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.model.dependency import Dependency
from cyclonedx.output.json import JsonV1Dot5
from packageurl import PackageURL

from build.context.dpkg_status import DebPackage
from contracts.lock import BuildLock


def render_sbom(lock: BuildLock, source_date_epoch: int, base_packages: tuple[DebPackage, ...] = ()) -> str:
    """`base_packages`: the Debian packages of the runtime base (build/context/dpkg_status.py), read from its dpkg
    database; the base itself is named by the image ID the lock records."""
    # Deterministic serial number and timestamp: equal locks give byte-identical SBOMs.
    bom = Bom(serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"ftimage:{lock.plan_key}"))
    bom.metadata.timestamp = datetime.datetime.fromtimestamp(source_date_epoch, datetime.UTC)
    root = Component(name=lock.image, version=lock.plan_key[:12], type=ComponentType.CONTAINER,
                     bom_ref=BomRef(f"ftimage:{lock.image}@{lock.plan_key}"))
    bom.metadata.component = root
    refs = []
    for pkg in lock.packages:
        ref = BomRef(f"pkg:pypi/{pkg.name}@{pkg.version}")
        bom.components.add(Component(
            name=pkg.name, version=pkg.version, type=ComponentType.LIBRARY, bom_ref=ref,
            purl=PackageURL("pypi", None, pkg.name, pkg.version, qualifiers={"file_name": pkg.filename}),
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=pkg.sha256)]))
        refs.append(ref)
    for kernel in lock.kernels:
        ref = BomRef(f"ftimage-kernel:{kernel.distribution}@{kernel.version}#{kernel.key[:16]}")
        bom.components.add(Component(
            name=kernel.distribution, version=kernel.version, type=ComponentType.LIBRARY, bom_ref=ref,
            purl=PackageURL("pypi", None, kernel.distribution, kernel.version, qualifiers={"file_name": kernel.wheel}),
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=kernel.sha256)],
            properties=[Property(name="ftimage:kernel-key", value=kernel.key),
                        Property(name="ftimage:kernel", value=kernel.name),
                        Property(name="ftimage:kind", value=kernel.kind),
                        Property(name="ftimage:archs", value=",".join(kernel.archs) or "-")]))
        refs.append(ref)
    for stage, image_id in sorted(lock.base_images.items()):
        if "." in stage:     # "runtime.rootfs", "runtime.debs-lock": properties of the stage's base
            continue
        ref = BomRef(f"ftimage-base:{stage}")
        details = [Property(name=f"ftimage:{key.partition('.')[2]}", value=value)
                   for key, value in sorted(lock.base_images.items()) if key.startswith(f"{stage}.") and value]
        bom.components.add(Component(name=f"base-{stage}", version=image_id, type=ComponentType.CONTAINER,
                                     bom_ref=ref, properties=details))
        refs.append(ref)
    for deb in base_packages:
        ref = BomRef(deb.purl)
        bom.components.add(Component(
            name=deb.name, version=deb.version, type=ComponentType.LIBRARY, bom_ref=ref,
            purl=PackageURL("deb", "debian", deb.name, deb.version, qualifiers={"arch": deb.arch}),
            properties=[Property(name="ftimage:source", value="runtime base /var/lib/dpkg/status")]))
        refs.append(ref)
    bom.dependencies.add(Dependency(ref=root.bom_ref, dependencies=[Dependency(ref=r) for r in refs]))
    return JsonV1Dot5(bom).output_as_string(indent=2) + "\n"
