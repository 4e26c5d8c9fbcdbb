"""Stage 2: rules that relate fields within one file (the schema checks each field alone).

Each rule records a Problem (file, field, problem, fix) and never raises, so one run
reports everything.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from build.spec.files import display_path, read_document
from build.spec.shapes import ENV_NAME, LABEL_KEY, UID_RANGE, ImageSpec, Kernel, Manifest, PinnedFile
from contracts.finetune_config import ConfigError, build_config, merge
from contracts.redact import mask_url
from contracts.schema import InvalidInput, Problems
from families import known_families

# Labels the build itself sets: a spec may not forge the image's provenance with them.
RESERVED_LABEL_PREFIXES = ("io.ftimage.",)
RESERVED_LABELS = ("org.opencontainers.image.title", "org.opencontainers.image.description",
                   "org.opencontainers.image.created", "org.opencontainers.image.version",
                   "org.opencontainers.image.base.name", "org.opencontainers.image.base.digest",
                   "org.opencontainers.image.revision")
_SECRET_KEY = re.compile(r"(password|passwd|secret|token|api[_-]?key|credential|private[_-]?key)", re.I)


class SpecErrors(InvalidInput):
    """All problems found in a build spec (exit code 2)."""
    title = "the build spec"


# ---- shared rules ----------------------------------------------------------------------

def pinned_requirement(req: str, where: str, file: str, problems: Problems) -> Requirement | None:
    """An exact `name==version` pin, nothing more: no URL, no extras, no environment marker (a
    marker can silently drop the package from the lock), no pip options smuggled in."""
    try:
        parsed = Requirement(req)
    except InvalidRequirement as exc:
        problems.add(file, where, f"not a valid requirement: {req!r} ({str(exc).splitlines()[0]})",
                     'write it as "name==1.2.3"', "bad-requirement")
        return None
    pins = [s for s in parsed.specifier if s.operator in ("==", "===") and "*" not in s.version]
    if parsed.url or parsed.extras or parsed.marker is not None:
        what = "a URL" if parsed.url else "extras" if parsed.extras else f"the marker `{parsed.marker}`"
        problems.add(file, where, f"{req!r} carries {what}", f'pin the plain package: "{parsed.name}==X.Y.Z"',
                     "bad-requirement")
        return None
    if len(pins) != 1 or len(parsed.specifier) != 1:
        problems.add(file, where, f"{req!r} is not pinned to one exact version",
                     f'pin it: "{parsed.name}==X.Y.Z" (the lock then holds its sha256)', "unpinned")
        return None
    return parsed


def specifier(spec: str, where: str, file: str, problems: Problems) -> None:
    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        problems.add(file, where, f"not a version range: {spec!r}", 'write a PEP 440 range like ">=2.4,<3"',
                     "bad-specifier")


def _url(pinned: PinnedFile, where: str, file: str, problems: Problems, *, required: bool) -> None:
    if not pinned.url:
        if required:
            problems.add(file, f"{where}.url", "required field is missing",
                         "give the exact https://files.pythonhosted.org/... URL of the file", "missing-field")
        return
    if not re.fullmatch(r"https://[A-Za-z0-9.-]+(?::\d{1,5})?/[A-Za-z0-9._~%+/-]*", pinned.url):
        problems.add(file, f"{where}.url", f"only https URLs are accepted (plain, no user info, no query), got "
                     f"{mask_url(pinned.url)[:80]!r}",
                     "use the https:// URL of the file", "bad-url")
    elif not pinned.url.endswith("/" + pinned.filename):
        problems.add(file, f"{where}.url", f"URL does not end in the pinned filename {pinned.filename!r}",
                     "make filename match the last part of the URL", "bad-url")


# ---- the manifest ----------------------------------------------------------------------

def manifest(m: Manifest, file: str, problems: Problems, repo_root: Path) -> None:
    for name, tc in m.toolchains.items():
        where = f"toolchains.{name}"
        if not tc.torch.wheels:
            problems.add(file, f"{where}.torch.wheels", "no torch wheel is pinned",
                         "pin the exact torch wheel per platform: filename and sha256", "missing-field")
        for i, req in enumerate(tc.cuda_pip_toolchain):
            pinned_requirement(req, f"{where}.cuda_pip_toolchain[{i}]", file, problems)
    for name, kernel in m.kernels.items():
        _kernel(kernel, f"kernels.{name}", file, problems, repo_root)


def _kernel(k: Kernel, where: str, file: str, problems: Problems, repo_root: Path) -> None:
    src = k.source
    if src.sdist and src.wheels:
        problems.add(file, f"{where}.source", "both sdist and wheels given",
                     "pin exactly one source: an sdist or prebuilt wheels")
    elif not src.sdist and not src.wheels and not problems.touches(file, f"{where}.source"):
        problems.add(file, f"{where}.source", "no source given", "pin source.sdist (url, filename, sha256) or "
                     "source.wheels", "missing-field")
    if k.kind == "cuda-extension":
        if src.wheels:
            problems.add(file, f"{where}.source.wheels", "a compiled kernel must be built from its sdist here",
                         "pin source.sdist; prebuilt CUDA wheels are how ABI mismatches get in (flash-attention #931)",
                         "prebuilt-cuda")
        for key, fix in (("extension_module", "name the compiled module, e.g. causal_conv1d_cuda"),
                         ("arch_knob", "name the env var the package's setup.py really reads for archs")):
            if not getattr(k, key):
                problems.add(file, f"{where}.{key}", "required field is missing", fix, "missing-field")
    if src.sdist:
        _url(src.sdist, f"{where}.source.sdist", file, problems, required=True)
    for i, wheel in enumerate(src.wheels):
        _url(wheel, f"{where}.source.wheels[{i}]", file, problems, required=True)
    for i, patch in enumerate(k.patches):
        pw = f"{where}.patches[{i}]"
        if patch.when_torch:
            specifier(patch.when_torch, f"{pw}.when_torch", file, problems)
        path = (repo_root / patch.path).resolve()
        if not path.is_relative_to((repo_root / "build" / "patches").resolve()):
            problems.add(file, f"{pw}.path", f"path {patch.path!r} points outside build/patches",
                         "keep patches in build/patches/", "path-outside")
        elif not path.is_file():
            problems.add(file, f"{pw}.path", f"file {patch.path!r} does not exist",
                         "create it, or fix the path (relative to the repository)", "missing-file")
        else:
            actual = hashlib.sha256(path.read_bytes()).hexdigest()
            if actual != patch.sha256:
                problems.add(file, f"{where}.patches", f"patch {patch.path} has sha256 {actual[:16]}..., the "
                             f"manifest pins {patch.sha256[:16]}...",
                             "restore the patch file, or re-pin its sha256 after reviewing the change", "bad-sha256")
    for key in ("python", "torch", "cuda"):
        value = getattr(k.constraints, key)
        if value:
            specifier(value, f"{where}.constraints.{key}", file, problems)
    for i, c in enumerate(k.runtime_constraints):
        specifier(c.version, f"{where}.runtime_constraints[{i}].version", file, problems)
    for section in ("runtime_requires", "build_requires"):
        for i, req in enumerate(getattr(k, section)):
            pinned_requirement(req, f"{where}.{section}[{i}]", file, problems)
    for key, value in k.build_env.items():
        if not re.fullmatch(ENV_NAME, key) or _SECRET_KEY.search(key):
            problems.add(file, f"{where}.build_env.{key}", "not an allowed environment variable name",
                         "use UPPER_CASE names for build knobs; never pass credentials to a build", "bad-format")
        if re.search(r"[\x00-\x1f]", value):
            problems.add(file, f"{where}.build_env.{key}", "control characters in a value",
                         "write the value on one line", "bad-format")
    for i, target in enumerate(k.replaces):
        if not re.fullmatch(r"[a-z][a-z0-9_]*|attention:[a-z0-9_]+", target):
            problems.add(file, f"{where}.replaces[{i}]", f"{target!r} is not a function or attention name",
                         'name a transformers function (causal_conv1d_fn) or "attention:flash_attention_2"')
    for function in k.python_api:
        if function not in k.replaces:
            problems.add(file, f"{where}.python_api.{function}", "names a function the kernel does not replace",
                         f"add {function} to replaces, or remove it here")
    if k.specialise is not None:
        for axis in ("head_dims", "dtypes"):
            knob = getattr(k.specialise, axis)
            if knob is not None and not knob.supported:
                problems.add(file, f"{where}.specialise.{axis}.supported", "empty", "list the supported values")


# ---- the image spec ----------------------------------------------------------------------

def image(spec: ImageSpec, file: str, problems: Problems) -> None:
    for i, req in enumerate(spec.python_requirements):
        parsed = pinned_requirement(req, f"python.requirements[{i}]", file, problems)
        if parsed and parsed.name.lower() == "torch":
            problems.add(file, f"python.requirements[{i}]", "torch is set by the toolchain, not here",
                         "remove torch from python.requirements; pick a toolchain instead", "torch-in-requirements")
    _duplicates(spec.kernels, "kernels", file, problems, "kernel")
    if len(set(spec.target_archs)) != len(spec.target_archs):
        problems.add(file, "target_archs", "an arch is listed twice", "list each arch once", "duplicate")
    for key in spec.labels:
        where = f"labels.{key}"
        if not re.fullmatch(LABEL_KEY, key):
            problems.add(file, where, "not a valid label key",
                         "use lowercase letters and digits separated by single '.' or '-' (reverse-DNS style, "
                         "e.g. org.example.team), at most 128 characters",
                         "bad-label")
        elif key.startswith(RESERVED_LABEL_PREFIXES) or key in RESERVED_LABELS:
            problems.add(file, where, "the build sets this label itself (image provenance)",
                         "remove it; use `description:` for the description, and your own prefix for your labels",
                         "reserved-label")
        elif _SECRET_KEY.search(key):
            problems.add(file, where, "label looks like it carries a secret (labels are public image metadata)",
                         "remove the secret; pass credentials at run time, never in the image", "secret")
    for stage in ("builder", "runtime"):
        ref = getattr(spec.bases, stage)
        where = f"bases.{stage}"
        if problems.touches(file, where) or problems.touches(file, "bases"):
            continue
        if ref.bootstrap_name and (ref.image or ref.digest):
            problems.add(file, where, "both bootstrap and image given",
                         "name either a bootstrapped base or a registry image")
        elif not ref.bootstrap_name and not ref.image:
            problems.add(file, f"{where}.image", "required field is missing",
                         "give image: REPO:TAG, ideally with digest: sha256:...", "missing-field")
        elif ref.image and ":" not in ref.image.rsplit("/", 1)[-1] and not ref.digest:
            problems.add(file, f"{where}.image", f"{ref.image!r} has neither a tag nor a digest",
                         "pin it: image: REPO:TAG plus digest: sha256:...", "unpinned")
    if spec.runtime.user == "root" and not problems.touches(file, "runtime"):
        problems.add(file, "runtime.user", "the runtime user may not be root", "name a non-root user, e.g. trainer",
                     "root-user")
    if spec.runtime.gid and spec.runtime.gid < UID_RANGE[0]:
        problems.add(file, "runtime.gid", f"gid {spec.runtime.gid} is a system group",
                     f"use a gid in {UID_RANGE[0]}..{UID_RANGE[1]}, or leave it out to use the uid", "root-user")
    _check_families(spec, file, problems)


def _check_families(spec: ImageSpec, file: str, problems: Problems) -> None:
    if spec.model_family and spec.model_families:
        problems.add(file, "model_families", "both model_family and model_families are given",
                     "keep model_family for one family, or list every family under model_families", "both-families")
        return
    if not spec.families:
        if not problems.touches(file, "model_family") and not problems.touches(file, "model_families"):
            problems.add(file, "model_families", "no model family is named",
                         f"add model_family: NAME or model_families: [NAME, ...] with names from: "
                         f"{', '.join(known_families())}", "missing-field")
        return
    where = "model_families" if spec.model_families else "model_family"
    _duplicates(spec.model_families, "model_families", file, problems, "family")
    for i, name in enumerate(spec.families):
        field = f"model_families[{i}]" if spec.model_families else "model_family"
        if name not in known_families() and not problems.touches(file, field):
            problems.add(file, field if spec.model_families else where, f"unknown model family {name!r}",
                         f"use one of: {', '.join(known_families())} (families/*.yaml)", "unknown-family")


def _duplicates(values: tuple[str, ...], field: str, file: str, problems: Problems, what: str) -> None:
    seen = set()
    for i, value in enumerate(values):
        if value in seen:
            problems.add(file, f"{field}[{i}]", f"{what} {value!r} is listed twice", f"list each {what} once",
                         f"duplicate-{what}")
        seen.add(value)


def finetune_defaults(spec: ImageSpec, file: str, problems: Problems) -> dict[str, Any]:
    """The image's finetune defaults (config_file < defaults), each layer validated with the
    finetune schema and its problems reported against the file they are in."""
    layers: list[tuple[str, str, dict]] = []
    if spec.finetune.config_file:
        path = (spec.directory / spec.finetune.config_file.replace("\x00", "")).resolve()
        if re.search(r"[\x00-\x1f\x7f]", spec.finetune.config_file):   # NUL would crash every os call
            problems.add(file, "finetune.config_file", "control characters (NUL, newline, ...) in a file name",
                         "give a plain relative path to a file inside the image folder", "bad-format")
        elif not path.is_relative_to(spec.directory.resolve()):
            problems.add(file, "finetune.config_file", f"path {spec.finetune.config_file!r} points outside the "
                         "image folder", "keep the file inside the image folder and use a relative path",
                         "path-outside")
        elif not path.is_file():
            problems.add(file, "finetune.config_file", f"file {spec.finetune.config_file!r} does not exist",
                         "create it, or fix the path (relative to the image folder)", "missing-file")
        else:
            loaded = read_document(path, problems, "finetune config")
            if loaded is not None:
                layers.append((display_path(path), "", loaded))
    if spec.finetune.defaults:
        layers.append((file, "finetune.defaults.", dict(spec.finetune.defaults)))
    merged: dict = {}
    # model.path and data.path are per run; everything else is checked here, at build time.
    for where_file, prefix, layer in layers:
        try:
            build_config([layer], require_paths=False)
        except ConfigError as exc:
            for p in exc.problems:
                problems.add(where_file, prefix + p.field, p.problem, p.fix, "finetune-config")
        merged = merge(merged, layer)
    if layers and not problems.touches(layers[-1][0], layers[-1][1].rstrip(".") or "(file)"):
        try:
            build_config([merged], require_paths=False)
        except ConfigError as exc:
            where_file, prefix, _ = layers[-1]
            for p in exc.problems:
                if not any(q.field.endswith(p.field) for q in problems):
                    problems.add(where_file, prefix + p.field, p.problem, p.fix, "finetune-config")
    return merged
