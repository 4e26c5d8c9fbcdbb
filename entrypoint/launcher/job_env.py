"""The environment every process of a job runs with, our own ranks and a user's command behind
the gate alike: writable JIT and library caches in this uid's private scratch, a usable HOME and
TMPDIR, and a user name for a uid the image's passwd does not know.

Clusters do not run images as the image says. OpenShift gives a random uid with gid 0; enroot and
Apptainer run the invoking uid on a read-only root, and the image's Env wins over the host's. So
the image's `HOME=/home/trainer` and `TRITON_CACHE_DIR=/home/trainer/.triton/cache` are not
writable there, and fla's first Triton JIT (or inductor's) fails on a GPU. A uid with no passwd
entry makes `getpass.getuser()` raise (`getpwuid(): uid not found`): torch's inductor cache
catches that, dynamo's debug folders and other libraries do not. getuser() reads LOGNAME and USER
first, so naming the uid there is enough.

Never output.dir: Triton loads the compiled launcher .so files it finds in its cache, so a cache
on a shared output volume would run whatever someone else put there.

torchrun keeps a folder per run for its workers' error files; without `--log-dir` it makes a new
`/tmp/torchelastic_*` each run and never removes it. PET_LOG_DIR is that flag as torchrun reads it
from the environment, so our torchrun and a gated command's both keep it in the private scratch:
a job writes nothing outside its output folder and this scratch.
"""
from __future__ import annotations

import os
import pwd
from pathlib import Path

from verify.scratch import CACHE_VARS, private_scratch

# verify's own JIT caches (it makes the same ones writable for itself), and the Hugging Face cache
CACHES = (*CACHE_VARS.items(), ("HF_HOME", "huggingface"))
USER_VARS = ("LOGNAME", "USER", "LNAME", "USERNAME")   # what getpass.getuser() reads before passwd
TORCHRUN_LOG_DIR = "PET_LOG_DIR"                        # torchrun's --log-dir, read from the environment


def job_env(env: dict | os._Environ) -> dict[str, str]:
    """What to add to `env` for a job's processes, for what the user did not set (or set
    unusably); the folders exist when it returns. Raises verify.scratch.NoScratch (naming every
    folder tried, with the fix) when this uid can write nowhere."""
    base = private_scratch(env)
    out: dict[str, str] = {}
    home = env.get("HOME", "")
    if not (home and os.path.isdir(home) and os.access(home, os.W_OK)):
        out["HOME"] = str(base / "home")
    tmp = env.get("TMPDIR") or "/tmp"
    if not os.access(tmp, os.W_OK):
        out["TMPDIR"] = str(base / "tmp")
    for name, sub in CACHES:
        if not writable_or_creatable(env.get(name)):
            out[name] = str(base / sub)
    if not env.get(TORCHRUN_LOG_DIR):
        out[TORCHRUN_LOG_DIR] = str(base / "torchelastic")
    prepare_dirs(out)
    if not env.get("HF_DATASETS_OFFLINE"):
        out["HF_DATASETS_OFFLINE"] = "1"   # data comes from mounted files: never wait on a hub
    out.update(identity_env(env))
    return out


def identity_env(env: dict | os._Environ) -> dict[str, str]:
    """USER and LOGNAME for a uid the passwd file does not know (and none of getuser()'s variables
    set), so `getpass.getuser()` answers instead of raising."""
    if any(env.get(name) for name in USER_VARS):
        return {}
    try:
        pwd.getpwuid(os.getuid())
        return {}
    except KeyError:
        name = f"uid{os.getuid()}"
        return {"USER": name, "LOGNAME": name}


def writable_or_creatable(path: str | None) -> bool:
    if not path:
        return False
    target = Path(path)
    while not target.exists() and target != target.parent:
        target = target.parent
    return target.is_dir() and os.access(target, os.W_OK)


def prepare_dirs(env: dict) -> None:
    for path in env.values():
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # the library that uses it will say what is wrong, with its own path


__all__ = ["job_env", "identity_env", "prepare_dirs", "writable_or_creatable"]
