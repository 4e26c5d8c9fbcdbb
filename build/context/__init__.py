"""Stage 5: the build context (Dockerfile, hash-locked wheelhouse, lock, SBOM, app code).

Names are imported lazily: `kernels build-here` on a bare GPU host needs the lock (lockfile.py)
but not the SBOM library that rendering a context uses.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"make_lock": "build.context.lockfile", "render_context": "build.context.render",
            "render_dockerfile": "build.context.render", "image_labels": "build.context.render",
            "RenderedContext": "build.context.render", "APP_PACKAGES": "build.context.render"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'build.context' has no attribute {name!r}")
