"""Stage 5: the build context (Dockerfile, hash-locked wheelhouse, lock, SBOM, app code)."""
from build.context.lockfile import make_lock
from build.context.render import APP_PACKAGES, RenderedContext, image_labels, render_context, render_dockerfile

__all__ = ["make_lock", "render_context", "render_dockerfile", "image_labels", "RenderedContext", "APP_PACKAGES"]
