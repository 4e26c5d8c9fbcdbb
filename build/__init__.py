"""ftimage's image builder: spec -> plan -> kernels -> context -> engine -> image.

Run from the repository root as `python -m build`. This package is deliberately not
installed into site-packages, where it would shadow PyPA's `build`.
"""
