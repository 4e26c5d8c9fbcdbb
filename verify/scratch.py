"""A writable place for verify's temp files and JIT caches, wherever the image runs.

A hardened deployment may run the image with a read-only root and no tmpfs (`docker run
--read-only`, Kubernetes readOnlyRootFilesystem) as an arbitrary uid whose HOME is not its
own. Docker and Kubernetes still give every container a writable /dev/shm, so verify uses
the first writable of TMPDIR, /tmp, /var/tmp and /dev/shm for its temp files, and points
the JIT caches it may touch (Triton, TorchInductor, XDG) there when theirs are unwritable.
Nothing here is left behind beyond the container's life: /dev/shm is memory.

The entrypoint's own commands need the same before they import torch: torch imports dill, which
asks tempfile for a temp dir at import time, and tempfile never tries /dev/shm. So on a read-only
root with no writable /tmp, `finetune` and `inspect-data` died in `import torch` with a traceback
(ensure_tempdir).
"""
from __future__ import annotations

import os
import pwd
import stat
import tempfile
from pathlib import Path

from contracts.errors import FixableError

CANDIDATES = ("/tmp", "/var/tmp", "/dev/shm")
CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor", "XDG_CACHE_HOME": "xdg",
              "MPLCONFIGDIR": "matplotlib"}


class NoScratch(FixableError):
    def __init__(self, tried: list[str]):
        super().__init__(f"no writable temporary directory (tried {', '.join(tried)})",
                         "mount a tmpfs at /tmp (docker or podman run --tmpfs /tmp:exec: Triton and inductor load "
                         "what they compile into their caches there; an emptyDir in Kubernetes), or set TMPDIR to a "
                         "writable path")


def _writable(path: str) -> bool:
    try:
        probe = tempfile.mkdtemp(prefix=".ftimage-probe-", dir=path)
    except OSError:
        return False
    os.rmdir(probe)
    return True


def _usable_dir(path: str | None) -> bool:
    if not path:
        return False
    target = Path(path)
    while not target.exists() and target != target.parent:
        target = target.parent   # a cache dir that does not exist yet is fine if its parent is writable
    return os.access(target, os.W_OK)


def private_dir(path: Path) -> Path:
    """`path` as a folder only this uid can write (created 0700; an existing one must be a real
    folder owned by this uid with no group/other write). JIT caches hold code that is loaded
    later (Triton's compiled launchers), so they never live where someone else can write.
    Raises NoScratch when `path` cannot be that."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        raise NoScratch([str(path)]) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022 or \
            not os.access(path, os.W_OK):
        raise NoScratch([f"{path} (not a private folder of uid {os.getuid()})"])
    return path


def private_scratch(env: os._Environ | dict = os.environ) -> Path:
    """This uid's private scratch: under HOME when it is writable, else under the first writable
    of TMPDIR, /tmp, /var/tmp, /dev/shm."""
    uid = os.getuid()
    home = env.get("HOME")
    candidates = [Path(home) / ".cache" / "ftimage"] if home and os.path.isdir(home) and \
        os.access(home, os.W_OK) else []
    candidates += [Path(t) / f"ftimage-{uid}" for t in (env.get("TMPDIR"), *CANDIDATES)
                   if t and os.path.isdir(t) and os.access(t, os.W_OK)]
    tried = []
    for candidate in candidates:
        try:
            return private_dir(candidate)
        except NoScratch:
            tried.append(str(candidate))
    raise NoScratch(tried or [str(Path(c)) for c in CANDIDATES])


def ensure_tempdir(env: os._Environ | dict = os.environ) -> str:
    """A temp dir tempfile can use, for a process about to import torch: tempfile's own choice
    when it finds one, else TMPDIR is pointed at this uid's private scratch (under /dev/shm on
    `docker run --read-only` with no tmpfs). Raises NoScratch, naming every folder tried, when
    this uid can write nowhere."""
    try:
        return tempfile.gettempdir()   # cached once found: the first caller decides, as in tempfile
    except FileNotFoundError:   # no writable TMPDIR, /tmp, /var/tmp, /usr/tmp or working directory
        pass
    chosen = private_dir(private_scratch(env) / "tmp")
    env["TMPDIR"] = str(chosen)
    tempfile.tempdir = None
    return str(chosen)


def home_of(env: os._Environ | dict) -> str | None:
    """HOME, else the passwd entry's home; None for a uid with neither. Path.home() raises
    RuntimeError there: a runtime that sets no HOME (`env -u HOME`, an OCI bundle whose
    config.json has none) for a uid the image's passwd does not know (OpenShift, `--user N`)."""
    if env.get("HOME"):
        return env["HOME"]
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return None


def ensure_scratch(env: os._Environ | dict = os.environ) -> Path:
    """Make TMPDIR and the JIT caches writable; returns the temp dir in use. Raises NoScratch."""
    candidates = [env["TMPDIR"]] if env.get("TMPDIR") else []
    candidates += [c for c in CANDIDATES if c not in candidates]
    chosen = next((c for c in candidates if os.path.isdir(c) and _writable(c)), None)
    if chosen is None:
        raise NoScratch(candidates)
    if env.get("TMPDIR") != chosen:
        env["TMPDIR"] = chosen
    tempfile.tempdir = None          # gettempdir() re-reads TMPDIR on its next call
    base = private_dir(Path(chosen) / f"ftimage-{os.getuid()}")
    home = home_of(env)
    for var, sub in CACHE_VARS.items():
        default = str(Path(home) / ".triton" / "cache") if var == "TRITON_CACHE_DIR" and home else None
        if not _usable_dir(env.get(var) or default):
            env[var] = str(base / sub)
    if not _usable_dir(home):
        env["HOME"] = str(base / "home")   # libraries that write under ~ (cache files) find a home
    return Path(chosen)
