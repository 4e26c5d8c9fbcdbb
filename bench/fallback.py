"""Make the fused kernel packages unimportable, as in a broken image, for side-by-side runs.

transformers resolves its kernels once, when the modeling module is imported, so this must
run before transformers is imported: the packages then look installed but broken (find_spec
succeeds, import raises, as with an ABI mismatch), and transformers falls back to its torch
reference functions exactly as it does in a broken image. flash_attn is left alone: the
fallback run simply uses sdpa, and transformers imports any flash_attn it finds eagerly.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

HIDDEN = ("fla", "causal_conv1d", "mamba_ssm")


class _BrokenLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(f"{module.__name__} hidden for the fallback run (bench/fallback.py)")


class HideFusedPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in HIDDEN:
            return None
        if importlib.machinery.PathFinder.find_spec(name, path) is None:
            return None  # not installed: nothing to hide
        return importlib.machinery.ModuleSpec(name, _BrokenLoader())


def hide_fused_packages() -> None:
    if "transformers" in sys.modules:
        raise RuntimeError("hide_fused_packages() must run before transformers is imported")
    sys.meta_path.insert(0, HideFusedPackages())
