"""The bootstrap every Python process of the image runs (`import guard.boot; guard.boot.install()`,
from a .pth line in the venv's site-packages; site processes those under `python -I` too).

It only watches: a `sys.meta_path` finder notices when the family's modeling module (e.g.
`transformers.models.qwen3_5.modeling_qwen3_5`) has finished executing and hands the module to
guard.activate. A process that never imports that module (`python -c pass`, pip, the build tool)
pays a directory listing and one small file read, and prints nothing. So this module imports os
and sys only: no torch, transformers, yaml, re or pathlib (tests/guard asserts it).

The watched names come from the `modeling_module:` line of each families/<name>.yaml, read here
with plain string methods: the family file stays the one source (no generated copy to drift), and
the strict reader (families.load_family) checks the whole file at activation.
"""

import os
import sys

FAMILIES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "families")
KEY = "modeling_module:"


def watched_modules(families_dir: str = FAMILIES_DIR) -> dict[str, str]:
    """modeling module -> family name, one per families/<name>.yaml that names one."""
    found: dict[str, str] = {}
    try:
        names = sorted(os.listdir(families_dir))
    except OSError:
        return found
    for name in names:
        if not name.endswith(".yaml"):
            continue
        try:
            with open(os.path.join(families_dir, name), encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith(KEY):
                        value = line[len(KEY):].split("#", 1)[0].strip().strip("'\"")
                        if value:
                            found[value] = name[: -len(".yaml")]
                        break
        except (OSError, UnicodeDecodeError):
            continue
    return found


class ModelingWatcher:
    """A meta path finder that finds nothing itself: for a watched name it asks the finders after
    it, and makes the spec's loader call `on_loaded(module, family)` once the module has executed."""

    def __init__(self, modules: dict[str, str], on_loaded=None, on_uncovered=None):
        self.modules = dict(modules)
        self.on_loaded = on_loaded or _activate
        self.on_uncovered = on_uncovered or _uncovered
        self.uncovered_seen: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        family = self.modules.get(fullname)
        if family is None:
            if not _is_other_modeling_module(fullname) or fullname in self.uncovered_seen:
                return None
            self.uncovered_seen.add(fullname)
            family = UNCOVERED
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self.modules.pop(fullname, None)      # once per process
        _after_exec(spec.loader, family, self.on_loaded if family != UNCOVERED else
                    lambda module, _family: self.on_uncovered(module))
        return spec

    def invalidate_caches(self) -> None:
        pass


UNCOVERED = ""       # the "family" of a transformers modeling module no family file names


def _is_other_modeling_module(fullname: str) -> bool:
    """transformers.models.<x>.modeling_<x>: a model package's modeling module (string methods only)."""
    if not fullname.startswith("transformers.models."):    # every import of every process passes here
        return False
    parts = fullname.split(".")
    return (len(parts) == 4 and parts[0] == "transformers" and parts[1] == "models"
            and parts[3] == f"modeling_{parts[2]}")


def _after_exec(loader, family: str, on_loaded) -> None:
    """Shadow the loader's exec_module on this loader instance only (module.__loader__ stays the
    same object, so inspect.getsource and friends keep working), and remove the shadow after."""
    plain = loader.exec_module

    def exec_module(module):
        try:
            plain(module)
        finally:
            loader.__dict__.pop("exec_module", None)
        on_loaded(module, family)

    loader.exec_module = exec_module


def _activate(module, family: str) -> None:
    # lazily: this module runs in every Python process; activate imports torch, families and yaml
    from guard import activate

    activate.on_import(module, family)


def _uncovered(module) -> None:
    # lazily, as _activate: coverage imports the families reader
    from guard import coverage

    coverage.on_import(module)


def install() -> ModelingWatcher | None:
    for finder in sys.meta_path:
        if isinstance(finder, ModelingWatcher):
            return finder
    modules = watched_modules()
    if not modules:
        return None
    watcher = ModelingWatcher(modules)
    sys.meta_path.insert(0, watcher)
    return watcher
