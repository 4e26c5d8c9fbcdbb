"""Provenance: whether the code behind a kernel came from an installed kernel distribution, or from
something that only says it is one.

A name proves nothing: a `.pth` line runs code at interpreter start, and a finder it puts on
`sys.meta_path` (or a `sys.path_hooks` entry) can serve a module called `causal_conv1d` from
anywhere, in plain torch that honours `seq_idx`. So a fused function counts only when:

- each module on its path (its own module and the packages above it) was loaded by the standard
  file loaders (SourceFileLoader, SourcelessFileLoader, ExtensionFileLoader) from the very file
  the standard FileFinder finds for that name, and the RECORD of an installed distribution (a
  *.dist-info on sys.path) lists that file with its sha256;
- its code (each layer of wrappers included) was compiled from files such a RECORD lists, the
  innermost from the kernel's own distribution;
- for a `cuda-extension` kernel, its compiled extension (e.g. causal_conv1d_cuda) was loaded the
  same way, from the same distribution;
- no import hook served any of them. A hook that only watches and delegates to the standard
  loader (the guard's ModelingWatcher) served nothing; this project's own hooks are named by their
  files' content (OWN_PTH; the guard's watcher beside this package, absent in an audit).

verify.import_facts reads the facts in the running interpreter; `judge_module` and `judge_kernel`
decide over them and are pure. Standard library only.
"""
from __future__ import annotations

import importlib.machinery
import os
from dataclasses import dataclass, field

LOADERS = {importlib.machinery.SourceFileLoader: "source", importlib.machinery.SourcelessFileLoader: "sourceless",
           importlib.machinery.ExtensionFileLoader: "extension"}
STANDARD = frozenset(LOADERS.values())
# What kernels_manifest.yaml declares, for an audit without a lock (tests/verify pins it to the manifest):
# import name -> (kind, the compiled module its entry points live in).
MANIFEST_KINDS = {"causal_conv1d": ("cuda-extension", "causal_conv1d_cuda"),
                  "flash_attn": ("cuda-extension", "flash_attn_2_cuda"), "fla": ("triton", ""),
                  "mamba_ssm": ("triton", "")}
# The runtime guard's .pth (guard.install_files(), written by build/oci/venv.py and the rendered
# Dockerfile), by its bytes' sha256; tests/verify pins it to guard.install_files().
OWN_PTH = {"ftimage-guard.pth": "8e704e2f0355adbd070605384a81248e37d30e6f3d1eeb43f1e34ff73fa487c2"}
# The guard's watcher is its boot.py as the build copied it beside verify/ (the app dir); an audit's
# payload carries no guard/, so there no finder is this project's own.
OWN_WATCHER = ("ModelingWatcher", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                               "guard", "boot.py"))
INSTALL = "install the kernel from its wheel (build the image with `python -m build`)"


@dataclass(frozen=True)
class Hook:
    """An import hook: a `.pth` line that runs code, or a non-standard finder, path hook or loader."""

    kind: str                          # "pth", "meta_path", "path_hook", "loader", or "finder" (unknown)
    name: str                          # the .pth's file name, or the class's qualified name
    file: str                          # the .pth, or the file that defines the class
    allowed: bool = False              # this project's own, identified by its file's content
    installed_by: tuple[str, ...] = ()  # the .pth files whose code imports it
    runs: tuple[str, ...] = ()          # a .pth: the files of the modules its `import` lines load

    def describe(self) -> str:
        if self.kind == "pth":
            return f".pth {self.file}" + (f" (runs {', '.join(self.runs)})" if self.runs else "")
        where = (f"{self.file}, which is not what the standard FileFinder finds for that name" if self.kind == "finder"
                 else f"{self.kind} {self.name} (defined in {self.file})")
        return where + (f", installed by {', '.join(self.installed_by)}" if self.installed_by else "")

    def files(self) -> tuple[str, ...]:
        return (self.file, *self.runs, *self.installed_by)


@dataclass(frozen=True)
class ModuleFacts:
    name: str
    loader: str                        # a STANDARD kind, "namespace", "other" or "none" (no spec)
    origin: str = ""                   # the file it was loaded from
    served_by: Hook | None = None      # None: the standard machinery served it (whoever was asked first)
    distribution: str = ""             # "name version" whose RECORD lists origin; "" when none does
    hash_ok: bool | None = None        # origin against that row's sha256 (None: the row has no sha256)
    hooks: tuple[Hook, ...] = ()       # every other hook in this interpreter (they did not serve it)


@dataclass(frozen=True)
class KernelFacts:
    what: str                          # "causal_conv1d.causal_conv1d_fn" or "`causal_conv1d`"
    kind: str                          # "cuda-extension", "triton", or "" (unknown)
    modules: tuple[ModuleFacts, ...]   # its home module first, then the packages above or below it
    code: tuple[tuple[str, str], ...] = ()   # (file, distribution vouching for it), outermost first
    extension: str = ""                # cuda-extension: the compiled module its entry points need
    extension_facts: ModuleFacts | None = None   # None: never loaded


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str                        # ok: where it came from; else the problem, naming the file
    fix: str = ""
    data: dict = field(default_factory=dict)


def judge_module(m: ModuleFacts) -> Verdict:
    """Pure: one module's facts -> PASS only if every condition of the rule holds."""
    data = {"module": m.name, "origin": m.origin, "distribution": m.distribution}
    if m.served_by is not None and not m.served_by.allowed:
        files = ", ".join(m.served_by.files())
        how = "has no import spec: code put it into sys.modules" if m.loader == "none" else \
            "was served by an import hook, not loaded from an installed distribution"
        return Verdict(False, f"`{m.name}` {how}: {m.served_by.describe()}",
                       f"remove {files} from the image and {INSTALL}", {**data, "hook": list(m.served_by.files())})
    if m.loader not in STANDARD:
        suspects = [*([m.served_by] if m.served_by else []), *(h for h in m.hooks if not h.allowed)]
        named = "; ".join(h.describe() for h in suspects) or "none found"
        how = "has no import spec (put into sys.modules by code)" if m.loader == "none" else \
            f"was not loaded by a standard file loader ({m.loader})"
        return Verdict(False, f"`{m.name}` {how}; import hooks here: {named}",
                       f"remove the hook ({', '.join(f for h in suspects for f in h.files()) or 'see DETAIL'}) "
                       f"and {INSTALL}", data)
    if not m.distribution or not m.origin:
        return Verdict(False, f"`{m.name}` comes from {m.origin or 'no file'}, which no installed distribution's "
                       "RECORD lists", f"{INSTALL}: a file copied or put on the path proves nothing", data)
    if m.hash_ok is not True:
        why = "has no sha256 in" if m.hash_ok is None else "differs from the sha256 in"
        return Verdict(False, f"{m.origin} {why} the RECORD of {m.distribution}",
                       f"reinstall {m.distribution} from its wheel; never edit installed files", data)
    return Verdict(True, f"{m.distribution}", data=data)


def judge_kernel(k: KernelFacts) -> Verdict:
    """Pure: a fused function (or a kernel package) -> PASS only if every module, every layer of its
    code and, for a cuda-extension, its compiled extension come from installed RECORDs, unserved."""
    if not k.modules:
        return Verdict(False, f"{k.what}: no module of it is loaded", INSTALL)
    home = k.modules[0]
    data = {"what": k.what, "kind": k.kind, "distribution": home.distribution, "package": home.name.split(".")[0]}
    for m in k.modules:
        v = judge_module(m)
        if not v.ok:
            return Verdict(False, v.detail, v.fix, {**data, **v.data})
    for file, vouched in k.code:
        if not vouched:
            return Verdict(False, f"{k.what} runs code from {file}, which no installed distribution's RECORD lists "
                           "(it was replaced or wrapped after import)",
                           f"remove what patches it ({file}) and {INSTALL}", {**data, "code": file})
    if k.code and k.code[-1][1] != home.distribution:
        file, vouched = k.code[-1]
        return Verdict(False, f"{k.what}'s code comes from {file} ({vouched}), not from {home.distribution}",
                       f"remove what patches it and {INSTALL}", {**data, "code": file})
    suffix = ""
    if k.kind == "cuda-extension":
        ext = k.extension_facts
        if not k.extension or ext is None:
            return Verdict(False, f"{k.what} is a cuda-extension kernel, but its compiled "
                           f"{k.extension or 'extension'} was never loaded: what runs is Python only",
                           f"{INSTALL}: its wheel ships {k.extension or 'the compiled extension'}", data)
        v = judge_module(ext)
        if not v.ok:
            return Verdict(False, v.detail, v.fix, {**data, **v.data})
        if ext.loader != "extension" or ext.distribution != home.distribution:
            return Verdict(False, f"{k.extension} comes from {ext.origin} ({ext.distribution}, {ext.loader}), not "
                           f"a compiled extension of {home.distribution}", f"{INSTALL}: one wheel, one distribution",
                           {**data, "extension": ext.origin})
        suffix = f" and its compiled {k.extension}"
    count = len(k.modules)
    return Verdict(True, f"from {home.distribution}: {count} module(s){suffix} loaded by the standard loaders, "
                   "files matching its RECORD", data={**data, "ok": True})


def refusal(v: Verdict | None) -> tuple[str, str] | None:
    """(detail, fix) when a verdict does not let a kernel count: a failed one, or none read (fail closed)."""
    if v is None:
        return "where it came from was not read", INSTALL
    return None if v.ok else (v.detail, v.fix)


def kind_of(package: str, lock=None) -> tuple[str, str]:
    """(kind, compiled extension) of a kernel package: the lock's (build/ copied the manifest's), or
    without a lock the manifest's own catalogue; ("", "") when neither knows it."""
    if lock is not None:
        for kernel in lock.kernels:
            if kernel.import_name == package:
                return kernel.kind, kernel.extension_module
    return MANIFEST_KINDS.get(package, ("", ""))
