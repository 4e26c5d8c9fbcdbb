"""The build spec: kernels_manifest.yaml, images/<name>/image.yaml and the bootstrap bases,
loaded in stages:

    shapes.py    the typed shapes (and per-field rules) of each file
    parse.py     safe YAML -> the schema engine -> typed objects
    validate.py  rules that relate fields within one file

Cross-file compatibility is build/resolve's job.
"""
from build.spec.parse import (
                              BASES_DIR,
                              MANIFEST_PATH,
                              REPO_ROOT,
                              display_path,
                              load_bootstrap_base,
                              load_image_spec,
                              load_manifest,
                              looks_secret,
)
from build.spec.shapes import (
                              ArchKnob,
                              BaseRef,
                              BootstrapBase,
                              ImageSpec,
                              Kernel,
                              KernelConstraints,
                              Manifest,
                              PinnedFile,
                              SourcePatch,
                              Specialise,
                              Toolchain,
)
from build.spec.validate import SpecErrors

__all__ = ["BASES_DIR", "MANIFEST_PATH", "REPO_ROOT", "display_path", "load_bootstrap_base", "load_image_spec",
           "load_manifest", "looks_secret", "ArchKnob", "BaseRef", "BootstrapBase", "ImageSpec", "Kernel",
           "KernelConstraints", "Manifest", "PinnedFile", "SourcePatch", "Specialise", "Toolchain", "SpecErrors"]
