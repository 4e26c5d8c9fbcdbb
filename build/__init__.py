"""ftimage's image builder (`python -m build`): spec -> plan -> bases, wheels, kernels -> context
-> image -> push. README.md in this folder maps the subpackages, one job each.

Run from the repository root. This package is deliberately not installed into site-packages,
where it would shadow PyPA's `build`.
"""
