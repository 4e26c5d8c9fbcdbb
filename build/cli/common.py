"""What every `python -m build` command shares: exit codes, the common options, the cache, and
the help text that lists every command (EPILOG, shown by `python -m build --help`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from build.cache import CACHE_LAYOUT, CacheLayout, default_cache_root
from build.remote_cache import RemoteCache
from contracts import folder_guard
from contracts.events import EventLog

EXIT_OK, EXIT_BUILD_FAILED, EXIT_BAD_SPEC, EXIT_REFUSED = 0, 1, 2, 3

EPILOG = """\
commands:
  IMAGE_DIR                     build images/<name>: bootstrap bases if needed, fill the wheelhouse,
                                compile or reuse kernels, render, build, check, tag <name>:<plan-key>
  IMAGE_DIR --plan [--json]     the resolved plan: toolchain, archs, each kernel's key, cache state,
                                specialisation and expected compile cost (nothing is built)
  IMAGE_DIR --render DIR        write the build context to DIR (a new or empty folder)
  IMAGE_DIR --kernels-only      only compile/check the plan's kernels into the cache
  IMAGE_DIR --push REPOSITORY   build, then push to REGISTRY/REPO and record the digest
  IMAGE_DIR --push REPOSITORY --sign KEY
                                also push a cosign signature and a SLSA provenance attestation
  IMAGE_DIR --push REPOSITORY --check-pull containerd[=SOCKET]
                                first pull the pushed digest with containerd; its refusal fails the push
  verify-reproducible IMAGE_DIR build twice from two fresh clones (fresh caches, another umask, time
                                zone and host name) and compare image ID, diffIDs and manifest digest
  verify-image REF --key PUB    check an image in a registry: signature, attestation, lock label
                                (exit 3 if any is refused)
  audit IMAGE [--json] [--gpus all|N] [--model DIR] [--families A,B|all]
                                run verify in ANY local image with Python >= 3.10, torch and transformers
                                (not built here): its own Python and user, no network, no lock; exit as
                                verify: 0 pass, 1 warn, 2 fail (an image it cannot run in: 2, with the fix)
  IMAGE_DIR --deploy-example {k8s-runtime,k8s-trainjob,k8s-trainjob-trl,k8s,slurm,slurm-oci}
                                render a deploy example for the pushed image, pinned by digest:
                                Kubeflow Trainer v2 runtime and TrainJobs, legacy PyTorchJob, sbatch
  bootstrap-base BASE_DIR       debootstrap a base from images/_bases/<base>/base.yaml (from its deb lock)
  bases update BASE_DIR         re-pin the base's .debs from the mirror's signed index (a reviewed change)
  bases export DIR | import DIR carry the locked .debs to a machine with no mirror (import re-hashes)
  kernels list                  list the kernel wheel cache (a corrupt entry is named)
  kernels export DIR [--sign KEY]   copy every cache entry to DIR with a manifest (signed: cosign format)
  kernels import DIR --key PUB      import entries from DIR, proving each one (or --trust-unsigned, logged)
  kernels fetch IMAGE_DIR       download the image's pinned sources into the cache (to carry offline)
  kernels check WHEEL --image TAG --kernel NAME
                                import a kernel wheel beside that image's torch (ABI + entry points)
  kernels build-here IMAGE_DIR [--arch sm_90] [--out DIR] [--install DIR] [--lock FILE]
                                compile and check the image's kernels on THIS machine, without Docker,
                                for its own Python, torch and GPU (the local cache, then any
                                --cache-registry, are asked first; --sign signs what it pushes there)

environment:
  FTIMAGE_CACHE                 cache root (default ~/.cache/ftimage)
  SOURCE_DATE_EPOCH             timestamp for labels, SBOM and context mtimes (default: HEAD's commit time)
  DOCKER_HOST                   the Docker engine to use

exit codes: 0 ok, 1 build failed, 2 invalid spec or arguments, 3 refused (kernels import, verify-image)
"""


def add_common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-logs", action="store_true", help="progress as JSON lines on stderr (one event schema)")
    p.add_argument("--cache", type=Path, default=None, help="cache root (default: $FTIMAGE_CACHE or ~/.cache/ftimage)")
    p.add_argument("--manifest", type=Path, default=None, help="kernels manifest (default: ./kernels_manifest.yaml)")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder this tool did not create "
                   "(same-named files are overwritten; nothing else is deleted)")


def open_cache(path: Path | None, *, force: bool = False, write: bool = True) -> CacheLayout:
    root = Path(path or default_cache_root())
    if write:
        folder_guard.claim(root, folder_guard.CACHE_MARKER, what="cache folder", option="--cache or FTIMAGE_CACHE",
                           force=force, adopt_layout=CACHE_LAYOUT)
    elif root.exists() and not root.is_dir():
        raise folder_guard.UnsafeFolder(f"cache folder {root} is a file", "point FTIMAGE_CACHE at a folder")
    cache = CacheLayout(root)
    if write:
        cache.sweep_scratch()
    return cache


def open_remote(options, log: EventLog):
    """The remote cache for these options (None without --cache-registry), its plan logged."""
    if options is None:
        return None
    log.emit("cache", f"remote cache {options.describe()}")
    if options.trust_unsigned:
        log.emit("cache", "WARNING: --trust-unsigned-cache: remote cache entries are used WITHOUT a verified "
                          "signature (each is still re-hashed against its own digests); recorded in the build report "
                          "and the lock")
    return RemoteCache(options, log)
