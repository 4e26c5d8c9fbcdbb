"""What a build did, as build-report.json: the image, its keys, time per phase, what each cache
gave, what was pruned, pushed and shared. Below the pipeline (which fills it) and the push (which
adds the digest), so that neither imports the other.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_NAME = "build-report.json"


@dataclass
class BuildReport:
    image: str
    tag: str
    image_id: str = ""
    size_bytes: int = 0
    plan_key: str = ""
    lock_sha256: str = ""
    context_sha256: str = ""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    steps: list[tuple[str, float]] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    pushed: dict[str, str] = field(default_factory=dict)    # filled by `--push`: repository, digest, reference
    remote_cache: dict[str, Any] = field(default_factory=dict)   # with --cache-registry: trust, hits, pushes
    builder: str = "oci"            # "oci": assembled by build/oci; "dockerfile": the classic builder
    manifest_digest: str = ""       # oci: the OCI manifest's sha256, which a push preserves
    diff_ids: list[str] = field(default_factory=list)
    layout: str = ""                # oci: the OCI image layout in the output folder
    layers_sent: int = 0            # oci: layers the engine was sent (the rest it already held)
    total_seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def render(self) -> str:
        lines = [f"built {self.tag}  ({self.image_id[:19]}, {self.size_bytes / 2 ** 30:.2f} GiB)",
                 f"plan {self.plan_key[:16]}  lock sha256 {self.lock_sha256[:16]}  context {self.context_sha256[:16]}",
                 "", f"{'PHASE':<12} {'SECONDS':>8}"]
        lines += [f"{phase:<12} {secs:>8.1f}" for phase, secs in self.phase_seconds.items()]
        lines += [f"{'total':<12} {self.total_seconds:>8.1f}", "", "CACHE"]
        lines += [f"  {what:<30} {state}" for what, state in self.cache.items()]
        if self.pruned:
            lines += ["", f"pruned superseded images: {', '.join(self.pruned)}"]
        if self.pushed:
            lines += ["", f"pushed {self.pushed['reference']}"]
        if self.remote_cache:
            rc = self.remote_cache
            lines += ["", f"remote cache {rc['repository']}: {rc['hits']} hit(s), "
                      f"{rc['bytes_pulled'] / 2 ** 20:.1f} MiB pulled, {rc['pushed']} pushed, trust: {rc['trust']}"
                      + (f"; UNAVAILABLE: {rc['unavailable']}" if rc["unavailable"] else "")]
            lines += [f"  refused {tag}: {why}" for tag, why in rc["refused"].items()]
        return "\n".join(lines)


@dataclass(frozen=True)
class PushRecord:
    """What build-report.json keeps under `pushed` after a push."""
    repository: str      # REGISTRY/REPO
    tag: str             # REGISTRY/REPO:<image tag>, the name the image was pushed under
    digest: str          # sha256:<64 hex>, the manifest digest the registry stores
    reference: str       # REGISTRY/REPO@sha256:..., what a deployment pins
    signature: str = ""  # with --sign: REGISTRY/REPO:sha256-<hex>.sig (cosign's layout)
    attestation: str = ""  # with --sign: REGISTRY/REPO:sha256-<hex>.att (SLSA provenance, DSSE)
    signed_by: str = ""  # with --sign: sha256 of the signing key's public half

    def to_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v}   # an unsigned push records no signature fields
