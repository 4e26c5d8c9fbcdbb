"""What the running interpreter says about where a module came from: the import hooks it holds
(`.pth` lines that run code, finders on sys.meta_path, sys.path_hooks entries), the spec and
loader each loaded module carries, the file the standard FileFinder would load for that name
instead, and the installed distribution whose RECORD lists a file, with its sha256.

Standard library only, and nothing is imported or executed here beyond what already ran (a
foreign hook is asked again only whether it answered for a name). verify.provenance decides over
these facts.
"""
from __future__ import annotations

import base64
import csv
import glob
import hashlib
import importlib.machinery
import inspect
import io
import os
import re
import site
import sys
import zipimport
from importlib import _bootstrap_external

from verify.provenance import LOADERS, OWN_PTH, OWN_WATCHER, STANDARD, Hook, KernelFacts, ModuleFacts

NAMESPACE_LOADER = getattr(importlib.machinery, "NamespaceLoader", None) or _bootstrap_external._NamespaceLoader
DETAILS = ((importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
           (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
           (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES))
STANDARD_META = (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter,
                 importlib.machinery.PathFinder)


def _sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return base64.urlsafe_b64encode(hashlib.sha256(fh.read()).digest()).rstrip(b"=").decode()
    except OSError:
        return None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _file_of(obj) -> str:
    try:
        return inspect.getfile(obj)
    except (TypeError, OSError):
        return "?"


def _code_file(obj) -> str:
    code = getattr(obj, "__code__", None)
    if code is not None and hasattr(code, "co_filename"):
        return code.co_filename
    if inspect.ismethod(obj):
        return _code_file(obj.__func__)
    if inspect.isbuiltin(obj) or inspect.ismethoddescriptor(obj):
        return ""   # C code: its module is an extension, judged with the modules
    return _file_of(type(obj))


def layers(func) -> list:
    """The callable and what it wraps (__wrapped__), outermost first."""
    chain, seen = [func], {id(func)}
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 16:
        inner = chain[-1].__wrapped__
        if id(inner) in seen:
            break
        chain.append(inner)
        seen.add(id(inner))
    return chain


class Survey:
    """The facts of this interpreter, read once per check (files are hashed once)."""

    def __init__(self) -> None:
        self._finders: dict[str, importlib.machinery.FileFinder] = {}
        self._records: dict[str, list[tuple[str, bytes]]] = {}
        self._rows: dict[str, dict[str, str]] = {}
        self._labels: dict[str, str] = {}
        self._hashes: dict[str, str | None] = {}
        self.dirs = self._site_dirs()
        self.pth = tuple(self._code_pth())
        # a venv's lib64 -> lib runs its .pth twice, so one hook may sit on sys.meta_path twice
        self.hooks = self.pth + tuple(dict.fromkeys(self._finder_hooks()))

    # -- hooks ---------------------------------------------------------------------------------
    @staticmethod
    def _site_dirs() -> list[str]:
        dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
        user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else ""
        dirs += [user] if isinstance(user, str) and user else []
        dirs += [p for p in sys.path if isinstance(p, str) and p]
        return list(dict.fromkeys(os.path.realpath(d) for d in dirs if os.path.isdir(d)))

    def _code_pth(self):
        """The .pth files whose lines run code (a line that starts with `import`); path lines run nothing."""
        for folder in self.dirs:
            for path in sorted(glob.glob(os.path.join(folder, "*.pth"))):
                try:
                    with open(path, "rb") as fh:
                        data = fh.read()
                except OSError:
                    continue
                if any(line.startswith((b"import ", b"import\t")) for line in data.splitlines()):
                    name = os.path.basename(path)
                    own = OWN_PTH.get(name) == hashlib.sha256(data).hexdigest()
                    specs = (self._standard_spec(top.decode()) for top in re.findall(rb"^import\s+(\w+)", data, re.M))
                    runs = tuple(dict.fromkeys(s.origin for s in specs if s not in (None, "namespace") and s.origin))
                    yield Hook("pth", name, path, own, runs=runs)

    def _installers(self, cls: type) -> tuple[str, ...]:
        top = (getattr(cls, "__module__", "") or "").split(".")[0]
        found = []
        for hook in self.pth:
            try:
                with open(hook.file, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except OSError:
                continue
            if top and re.search(rf"\b(import|from)\s+{re.escape(top)}\b", text):
                found.append(hook.file)
        return tuple(found)

    def _class_hook(self, kind: str, cls: type, allowed: bool = False) -> Hook:
        return Hook(kind, f"{cls.__module__}.{cls.__qualname__}", _file_of(cls), allowed, self._installers(cls))

    def _finder_hooks(self):
        own_name, own_file = OWN_WATCHER
        own_hash = _sha256(own_file) if os.path.isfile(own_file) else None
        for finder in sys.meta_path:
            if any(finder is s for s in STANDARD_META):
                continue
            cls = finder if isinstance(finder, type) else type(finder)
            own = cls.__name__ == own_name and own_hash is not None and _sha256(_file_of(cls)) == own_hash
            yield self._class_hook("meta_path", cls, own)
        for hook in sys.path_hooks:
            if hook is zipimport.zipimporter or _standard_path_hook(hook):
                continue
            if inspect.isfunction(hook):
                yield Hook("path_hook", hook.__qualname__, _code_file(hook), False, self._installers(hook))
            else:
                yield self._class_hook("path_hook", hook if isinstance(hook, type) else type(hook))

    # -- where the standard machinery would load a name from -------------------------------------
    def _standard_spec(self, name: str):
        parent = name.rpartition(".")[0]
        search = list(getattr(sys.modules.get(parent), "__path__", None) or []) if parent else list(sys.path)
        namespace = False
        for entry in search:
            if not isinstance(entry, str):
                continue
            entry = os.path.abspath(entry or os.getcwd())
            if not os.path.isdir(entry):
                continue
            finder = self._finders.setdefault(entry, importlib.machinery.FileFinder(entry, *DETAILS))
            spec = finder.find_spec(name)
            if spec is not None and spec.loader is None:
                namespace = True
            elif spec is not None:
                return spec
        return "namespace" if namespace else None

    # -- RECORD ----------------------------------------------------------------------------------
    def _record_files(self, folder: str) -> list[tuple[str, bytes]]:
        if folder not in self._records:
            found = []
            for record in sorted(glob.glob(os.path.join(folder, "*.dist-info", "RECORD"))):
                try:
                    with open(record, "rb") as fh:
                        found.append((record, fh.read()))
                except OSError:
                    continue
            self._records[folder] = found
        return self._records[folder]

    def _label(self, record: str) -> str:
        if record not in self._labels:
            name = version = ""
            try:
                with open(os.path.join(os.path.dirname(record), "METADATA"), encoding="utf-8", errors="replace") as fh:
                    for line in fh:
                        if not line.strip():
                            break
                        key, _, value = line.partition(":")
                        name = value.strip() if key == "Name" and not name else name
                        version = value.strip() if key == "Version" and not version else version
            except OSError:
                pass
            self._labels[record] = f"{name or os.path.basename(os.path.dirname(record))} {version}".strip()
        return self._labels[record]

    def record_of(self, path: str) -> tuple[str, bool | None]:
        """(the distribution whose RECORD lists `path`, whether its sha256 matches); ("", None) if none
        does. Where two RECORDs list one file (a package split over two wheels), the matching one wins."""
        found: tuple[str, bool | None] = ("", None)
        for candidate in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
            for folder in self.dirs:
                if not candidate.startswith(folder + os.sep):
                    continue
                rel = candidate[len(folder) + 1:].replace(os.sep, "/")
                for record, data in self._record_files(folder):
                    if rel.encode() not in data:   # most RECORDs are ruled out without parsing them
                        continue
                    if record not in self._rows:
                        rows = csv.reader(io.StringIO(data.decode("utf-8", "replace")))
                        self._rows[record] = {r[0]: r[1] for r in rows if len(r) >= 2}
                    if rel not in self._rows[record]:
                        continue
                    algo, _, want = self._rows[record][rel].partition("=")
                    if candidate not in self._hashes:
                        self._hashes[candidate] = _sha256(candidate)
                    ok = (self._hashes[candidate] == want) if algo == "sha256" and want else None
                    if ok:
                        return self._label(record), True
                    found = found if found[0] else (self._label(record), ok)
        return found

    # -- facts -----------------------------------------------------------------------------------
    def module_facts(self, name: str) -> ModuleFacts | None:
        """None for a namespace package the standard finder also finds as one (it runs no code)."""
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is None or spec is None:
            return ModuleFacts(name, "none", served_by=self._naming(name.split(".")[0]), hooks=self.hooks)
        loader = type(getattr(spec, "loader", None))
        kind = LOADERS.get(loader) or ("namespace" if loader is NAMESPACE_LOADER else "other")
        claimed = getattr(spec, "origin", None)
        origin = claimed if isinstance(claimed, str) and getattr(spec, "has_location", False) else ""
        if kind in STANDARD:   # the file a file loader really executes is its own path, whatever the spec says
            origin = getattr(spec.loader, "path", None) or origin
        standard = self._standard_spec(name)
        if kind == "namespace" and standard == "namespace" and not origin:
            return None
        same = (standard not in (None, "namespace") and origin and type(standard.loader) is loader
                and os.path.realpath(standard.origin) == os.path.realpath(origin))
        served = None if same else self._server(name, spec, kind)
        distribution, hash_ok = self.record_of(origin) if origin else ("", None)
        return ModuleFacts(name, kind, origin, served, distribution, hash_ok, self.hooks)

    def _server(self, name: str, spec, kind: str) -> Hook:
        """The hook that served a module the standard machinery would not have loaded as it is."""
        if kind not in STANDARD and kind != "namespace":
            return self._class_hook("loader", type(getattr(spec, "loader", None)))
        origin = getattr(spec, "origin", None) or ""
        for entry, finder in list(sys.path_importer_cache.items()):
            if type(finder) not in (type(None), importlib.machinery.FileFinder, zipimport.zipimporter) and \
                    isinstance(entry, str) and entry and origin.startswith(entry.rstrip(os.sep) + os.sep):
                return self._class_hook("path_hook", type(finder))
        parent_path = getattr(sys.modules.get(name.rpartition(".")[0]), "__path__", None)
        for finder in sys.meta_path:
            hook = next((h for h in self.hooks if h.kind == "meta_path" and h.name == _qualified(finder)), None)
            if hook is None or hook.allowed:
                continue
            try:   # it already ran at import; asked again, it says whether it is the one that answered
                found = finder.find_spec(name, parent_path)
            except Exception:  # noqa: BLE001 - a hook that raises is not the one that served it
                continue
            if found is not None and getattr(found, "origin", None) == getattr(spec, "origin", None):
                return hook
        suspect = self._naming(name.split(".")[0])
        return Hook("finder", "", origin or "?", installed_by=suspect.files() if suspect else
                    tuple(h.file for h in self.pth if not h.allowed))

    def _naming(self, name: str) -> Hook | None:
        """The foreign hook whose code names `name`: the likeliest to have put a module without an
        import spec into sys.modules (a .pth counts with the modules its `import` lines load)."""
        word = re.compile(rb"\b" + re.escape(name.encode()) + rb"\b")
        for hook in (h for h in self.hooks if not h.allowed):
            if any(word.search(_read(f)) for f in hook.files()):
                return hook
        return None

    def function_facts(self, func, kind: str, extension: str) -> KernelFacts:
        chain = layers(func)
        inner = chain[-1]
        home = getattr(inner, "__module__", None) or ""
        names = [home] + [home.rsplit(".", i)[0] for i in range(1, home.count(".") + 1)]
        vouched = {f: self.record_of(f) for f in (_code_file(c) for c in chain) if f}
        code = tuple((f, dist if ok else "") for f, (dist, ok) in vouched.items())
        return self._kernel(f"{home}.{getattr(inner, '__qualname__', '?')}", kind, names, code, extension)

    def package_facts(self, package: str, kind: str, extension: str) -> KernelFacts:
        below = sorted(n for n, m in list(sys.modules.items()) if m is not None and n.startswith(package + "."))
        return self._kernel(f"`{package}`", kind, [package, *below], (), extension)

    def _kernel(self, what: str, kind: str, names: list[str], code, extension: str) -> KernelFacts:
        modules = tuple(f for f in (self.module_facts(n) for n in names if n) if f is not None)
        ext = self.module_facts(extension) if kind == "cuda-extension" and extension in sys.modules else None
        return KernelFacts(what, kind, modules, code, extension, ext)

    def on_disk(self, package: str) -> tuple[str, str]:
        """(distribution, file) the standard finder would import `package` from, without importing it."""
        spec = self._standard_spec(package)
        if spec in (None, "namespace"):
            return "", ""
        distribution, ok = self.record_of(spec.origin)
        return (distribution if ok else ""), spec.origin


def _standard_path_hook(hook) -> bool:
    """FileFinder.path_hook's closure over the standard loaders only."""
    if getattr(hook, "__qualname__", "") != "FileFinder.path_hook.<locals>.path_hook_for_FileFinder":
        return False
    try:
        details = inspect.getclosurevars(hook).nonlocals.get("loader_details", ())
    except (TypeError, ValueError):
        return False
    return bool(details) and all(loader in LOADERS for loader, _ in details)


def _qualified(finder) -> str:
    cls = finder if isinstance(finder, type) else type(finder)
    return f"{cls.__module__}.{cls.__qualname__}"
