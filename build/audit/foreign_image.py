"""`python -m build audit IMAGE`: run this checkout's verify inside ANY local image that has
Python >= 3.10, torch and transformers, an image this project did not build.

How it runs, so nothing of the image is modified and nothing of it is trusted:
  1. IMAGE is checked against Docker's reference grammar (it is hostile input) and must be in
     the local engine (audit never pulls: it runs with no network).
  2. A tiny probe finds the image's own interpreter (`python3`, then `python`, resolved on the
     PATH of the image's config, as `docker run` would) and what it can import. An image
     without Python, with Python < 3.10, without torch or without transformers is refused,
     naming what is missing and the fix (exit 2), before verify is run.
  3. verify, contracts and families are staged in a temp folder with pure-Python copies of
     the third-party modules verify needs that the image lacks (verify_payload.py), mounted
     read-only; the carried modules sit behind the image's own site-packages.
  4. verify runs as `verify --no-lock` with the image's interpreter (`-I -B`), entrypoint
     overridden, `--network none`, as the image's own user (its config's User; none means
     root, Docker's default). Its exit code (0 pass, 1 warn, 2 fail) is the audit's.
The container and the temp folder are removed afterwards. The lock of an image built by this
project is not read either: the audit is the same for every image (`docker run IMAGE verify`
is what checks an ftimage image against its own lock).
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from build.audit.verify_payload import (
    REQUIRED_FROM_IMAGE,
    Payload,
    PayloadError,
    distribution_of,
    stage,
    third_party_imports,
    to_carry,
)
from build.engine import ContainerStartFailed, Engine
from build.spec.shapes import IMAGE_REF, SHA256
from contracts.errors import FixableError
from families import NAME, known_families

MIN_PYTHON = (3, 10)
INTERPRETERS = ("python3", "python")
MOUNT = "/ftimage-audit"              # src/ and deps/, read-only
MODEL_MOUNT = "/ftimage-audit-model"  # --model DIR, read-only
AUDIT_LABEL = {"io.ftimage.audit": "1"}
PROBE_MARK = "FTIMAGE-AUDIT-PROBE "
VERIFY_CRASHED = 3                    # the bootstrap's code when verify itself cannot start
REFERENCE = re.compile(rf"(?:{IMAGE_REF})(?:@sha256:{SHA256})?|sha256:{SHA256}")
MAX_REFERENCE = 512
NEEDS = "audit needs an image with Python >= 3.10, torch and transformers"

# Runs under any Python the image may have, 2.7 included, so it can say which it found.
PROBE = r"""
import sys, json
sys.path = [p for p in sys.path if p not in ("", ".")]
names = json.loads(sys.argv[1])
try:
    import importlib.util
    def find(name):
        return importlib.util.find_spec(name) is not None
except Exception:
    import imp
    def find(name):
        try:
            imp.find_module(name)
            return True
        except ImportError:
            return False
try:
    import importlib.metadata as md
except Exception:
    md = None
out = {"executable": sys.executable, "version": list(sys.version_info[:3]), "modules": {}}
for name, dist in names:
    try:
        found = bool(find(name))
    except Exception:
        found = False
    version = None
    if found and md is not None:
        try:
            version = md.version(dist)
        except Exception:
            version = None
    out["modules"][name] = {"found": found, "version": version}
sys.stdout.write("FTIMAGE-AUDIT-PROBE " + json.dumps(out) + "\n")
"""

BOOTSTRAP = f"""
import sys
sys.dont_write_bytecode = True
sys.path.insert(0, "{MOUNT}/src")
sys.path.append("{MOUNT}/deps")
sys.argv = ["verify"] + sys.argv[1:]
try:
    import runpy
    # as `python -m verify` runs: __main__ is verify.__main__ (an image's runtime guard, e.g.
    # ftimage's, knows that process and stands aside in it)
    runpy.run_module("verify", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit:
    raise
except BaseException as exc:
    sys.stderr.write("ftimage-audit: verify could not run in this image: %s: %s\\n" % (type(exc).__name__, exc))
    code = {VERIFY_CRASHED}
sys.exit(code)
"""


class AuditRefused(FixableError):
    """Nothing was audited (exit 2): a bad reference, a missing image, an image verify cannot run in."""

    exit_code = 2   # build/cli/audit_command.py: EXIT_FAIL

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def validate_reference(ref: str) -> str:
    """IMAGE as Docker's reference grammar allows it ([registry/]repo[:tag][@sha256:...], or an
    image ID); anything else never reaches the engine's API."""
    if not ref or len(ref) > MAX_REFERENCE or REFERENCE.fullmatch(ref) is None:
        shown = ref[:80].encode("unicode_escape").decode()
        raise AuditRefused(f"{shown!r} is not a Docker image reference",
                           "name a local image as [registry/]repository[:tag][@sha256:<64 hex>] (lowercase "
                           "repository) or by its image ID, e.g. `docker images` lists them")
    return ref


@dataclass(frozen=True)
class Probe:
    executable: str
    version: tuple[int, ...]
    modules: dict[str, dict] = field(default_factory=dict)   # name -> {"found": bool, "version": str|None}

    def has(self, module: str) -> bool:
        return bool(self.modules.get(module, {}).get("found"))

    def version_of(self, module: str) -> str:
        return self.modules.get(module, {}).get("version") or "?"

    @property
    def python(self) -> str:
        return ".".join(map(str, self.version))


def parse_probe(output: str) -> Probe | None:
    for line in output.splitlines():
        if line.startswith(PROBE_MARK):
            try:
                data = json.loads(line[len(PROBE_MARK):])
                return Probe(str(data["executable"]), tuple(int(v) for v in data["version"]),
                             {str(k): dict(v) for k, v in data["modules"].items()})
            except (ValueError, KeyError, TypeError):
                return None
    return None


def refusal(probe: Probe | None, tried: tuple[str, ...] = INTERPRETERS, path: str = "") -> AuditRefused | None:
    """Pure: why verify cannot run in the image the probe saw (None: it can)."""
    if probe is None:
        where = f" (PATH={path})" if path else ""
        return AuditRefused(f"the image has no Python: none of {', '.join(tried)} is on its PATH{where}",
                            f"{NEEDS}: install python3 (>= 3.10) with torch and transformers into it, e.g. in a "
                            "Dockerfile FROM it, or audit the image that has them")
    lacks = [m for m in REQUIRED_FROM_IMAGE if not probe.has(m)]
    if tuple(probe.version[:2]) < MIN_PYTHON:
        also = f" (and it has no {' and no '.join(lacks)})" if lacks else ""
        return AuditRefused(f"verify cannot run in this image: {probe.executable} is Python {probe.python}, verify "
                            f"needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}{also}",
                            f"{NEEDS}: install python3 >= 3.10 with torch and transformers into it (e.g. in a "
                            "Dockerfile FROM it), or audit the image your training really runs in")
    if lacks:
        return AuditRefused(f"verify cannot run in this image: {probe.executable} (Python {probe.python}) has no "
                            f"{' and no '.join(lacks)}",
                            f"{NEEDS}: install {' and '.join(lacks)} for {probe.executable} (e.g. `"
                            f"{probe.executable} -m pip install {' '.join(lacks)}` in a Dockerfile FROM it), or audit "
                            "the image your training really runs in")
    return None


def parse_gpus(value: str | None) -> int | None:
    """--gpus all|N -> the engine's count (-1 all); None: no GPUs."""
    if value is None:
        return None
    if value == "all":
        return -1
    if value.isdigit() and 0 < int(value) <= 1024:
        return int(value)
    raise AuditRefused(f"--gpus {value[:40]!r} is neither `all` nor a count", "pass --gpus all or --gpus N (N >= 1)")


def describe_user(config_user: str) -> str:
    if not config_user:
        return "root: the image's config sets no User, so Docker runs it as root, as `docker run` would"
    return f"{config_user} (the image's config User)"


@dataclass
class Audit:
    """One audit: what was found, and what to print."""

    ref: str
    info: dict
    probe: Probe | None = None
    payload: Payload | None = None
    notes: list[str] = field(default_factory=list)


def _probe(engine: Engine, audit: Audit, modules: tuple[str, ...], user: str | None) -> Probe:
    names = json.dumps([[m, distribution_of(m)] for m in modules])
    path = next((e.partition("=")[2] for e in audit.info.get("Config", {}).get("Env") or [] if e.startswith("PATH=")),
                "")
    first: AuditRefused | None = None
    for interpreter in INTERPRETERS:
        try:
            result = engine.run(audit.ref, [names], entrypoint=[interpreter, "-E", "-s", "-c", PROBE],
                                network="none", user=user, timeout=120, labels=AUDIT_LABEL)
        except ContainerStartFailed as exc:
            if exc.executable_missing:
                continue
            raise
        probe = parse_probe(result.stdout or result.output)
        if probe is None:
            tail = " / ".join(result.output.strip().splitlines()[-2:])[:300]
            first = first or AuditRefused(f"`{interpreter}` in the image did not answer the probe (exit "
                                          f"{result.exit_code}): {tail or 'no output'}",
                                          f"{NEEDS}; check that `{interpreter}` is a working Python")
            continue
        refused = refusal(probe)
        if refused is None:
            return probe
        first = first or refused
    raise first or refusal(None, INTERPRETERS, path)


def verify_args(json_report: bool, model: Path | None, families: str | None = None) -> list[str]:
    args = ["--no-lock"] + (["--json"] if json_report else [])
    args += ["--families", families] if families else []
    return args + (["--model", MODEL_MOUNT] if model else [])


def check_families(spec: str | None) -> str | None:
    """`--families all` or a comma list of family names, checked before it reaches the container
    (verify there refuses a name it does not know, with the list it knows)."""
    if spec is None or spec == "all":
        return spec
    names = [n.strip() for n in spec.split(",")]
    bad = [n for n in names if not re.fullmatch(NAME, n)]
    if bad or not names:
        raise AuditRefused(f"--families {spec!r} is not `all` or a comma list of family names",
                           f"give names like qwen3_5_text,granitemoehybrid (known: {', '.join(known_families())})")
    return ",".join(names)


def audit_image(engine: Engine, ref: str, *, json_report: bool = False, gpus: int | None = None,
                model: Path | None = None, timeout: float = 3600, families: str | None = None,
                say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                emit: Callable[[str], None] = sys.stdout.write) -> int:
    """The audit end to end; returns verify's exit code. Raises AuditRefused (exit 2) when
    nothing could be audited; BuildFailure for an engine failure."""
    validate_reference(ref)
    families = check_families(families)
    info = engine.image(ref)
    if info is None:
        raise AuditRefused(f"image {ref} is not in this Docker engine; audit never pulls (it runs with no network)",
                           f"`docker pull {ref}` (or `docker load` it) first, then rerun")
    if model is not None and not (model.is_dir() and (model / "config.json").is_file()):
        raise AuditRefused(f"--model {model} is not a model directory with a config.json",
                           "point --model at a HF-format model directory on this host")
    audit = Audit(ref, info)
    config = info.get("Config") or {}
    user = config.get("User") or ""
    imports = third_party_imports()
    audit.probe = _probe(engine, audit, imports, user or None)
    missing = tuple(m for m in to_carry(imports) if not audit.probe.has(m))
    labels = config.get("Labels") or {}
    origin = (f"built by ftimage (its lock {labels['io.ftimage.lock.path']} is not read: `docker run {ref} verify` "
              "checks it against its lock)" if labels.get("io.ftimage.lock.path") else "not built by ftimage")
    say(f"audit of {ref} ({info.get('Id', '?')[:19]}), {origin}")
    say(f"  python: {audit.probe.executable} {audit.probe.python}; torch {audit.probe.version_of('torch')}; "
        f"transformers {audit.probe.version_of('transformers')}")
    say(f"  user: {describe_user(user)}")
    say(f"  network: none; GPUs: {'all' if gpus == -1 else gpus or 'none'}; verify mounted read-only at {MOUNT}; "
        "nothing in the image is modified")
    try:
        audit.payload = stage(missing)
    except PayloadError as exc:
        raise AuditRefused(str(exc), exc.fix) from None
    try:
        if audit.payload.carried:
            say("  carried behind the image's site-packages: "
                + "; ".join(c.describe() for c in audit.payload.carried))
        volumes = {str(audit.payload.root): {"bind": MOUNT, "mode": "ro"}}
        if model is not None:
            volumes[str(model.resolve())] = {"bind": MODEL_MOUNT, "mode": "ro"}
        # One OpenMP thread: the probes' models are tiny, and on a busy host (a CI runner) torch's
        # thread per core spins while its partner waits for a core, several times the CPU for
        # the same verdicts. The image's own environment is otherwise left as it is.
        result = engine.run(ref, verify_args(json_report, model, families),
                            entrypoint=[audit.probe.executable, "-I", "-B", "-c", BOOTSTRAP], network="none",
                            volumes=volumes, user=user or None, timeout=timeout, labels=AUDIT_LABEL, gpus=gpus,
                            environment={"OMP_NUM_THREADS": "1"})
    finally:
        audit.payload.remove()
    return _report(result, json_report, emit)


def _report(result, json_report: bool, emit: Callable[[str], None]) -> int:
    stdout = result.stdout or ""
    tail = "\n".join(result.output.strip().splitlines()[-30:])
    if result.exit_code not in (0, 1, 2):
        raise AuditRefused(f"verify did not complete in the image (exit {result.exit_code}):\n{tail}",
                           "read the output above; the image's torch or transformers may not import")
    if json_report:
        try:
            report = json.loads(stdout)
        except ValueError:
            raise AuditRefused(f"verify printed no JSON report (exit {result.exit_code}):\n{tail}",
                               "read the output above") from None
        if report.get("exit_code") != result.exit_code:
            raise AuditRefused(f"verify's report says exit {report.get('exit_code')}, the container exited "
                               f"{result.exit_code}", "read the report; report this as a verify bug")
    elif "RESULT:" not in stdout:
        raise AuditRefused(f"verify printed no report (exit {result.exit_code}):\n{tail}", "read the output above")
    emit(stdout)
    return result.exit_code
