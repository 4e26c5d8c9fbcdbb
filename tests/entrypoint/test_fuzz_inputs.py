"""Hypothesis fuzz of the job's inputs, in-process (no CLI spawns): finetune configs, data rows and
kernel export folders. Same assertions as the spec fuzz: a clean verdict (accepted, or refused
with the field and a fix; 3 for a refused import), no traceback, nothing outside the workspace
touched, no code run."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.unit
EXAMPLES = 200
MARKER = "/tmp/ftimage-fuzz-pwned"      # any hostile string that "runs" would create it

HOSTILE_TEXT = st.sampled_from([
    "../outside/x", "/etc", "/etc/passwd", "/", "/proc/self", "/opt/ftimage/app", "a\x00b", "$(touch " + MARKER + ")",
    "`touch " + MARKER + "`", "; touch " + MARKER, "{{ x }}", "\u2028", "~", "-1", "1e400", "nan", "inf", "",
    "x" * 300, "\\", "'", '"', "true", "null", "[1, 2]", "{a: 1}", "0x10", "99999999999999999999999",
]) | st.text(max_size=16)
HOSTILE_VALUE = st.recursive(
    HOSTILE_TEXT | st.integers() | st.floats() | st.booleans() | st.none(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)
CONFIG_KEYS = ["model.path", "model.tokenizer", "model.attn_implementation", "model.trust_remote_code",
               "data.path", "data.format", "data.max_length", "data.max_rows", "data.max_row_bytes",
               "data.max_messages", "packing.mode", "packing.budget", "train.lr", "train.max_steps",
               "train.warmup_steps", "train.seed", "parallel.param_dtype", "checkpoint.resume", "checkpoint.keep",
               "output.dir", "output.profile_steps", "output.log_every", "launch.nproc_per_node",
               "launch.master_port", "launch.timeout_minutes", "nonsense.key", "train.nonsense"]


def _snapshot(root: Path) -> dict[str, tuple[float, int]]:
    return {str(p): (p.lstat().st_mtime, p.lstat().st_size) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, fixture_dir):
    root = tmp_path_factory.mktemp("fuzz-inputs")
    (root / "outside").mkdir()
    (root / "outside" / "x").write_text("untouched")
    ws = root / "ws"
    ws.mkdir()
    shutil.copytree(fixture_dir.model_dir, ws / "model")
    shutil.copy(fixture_dir.data, ws / "data.jsonl")
    return root


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), HOSTILE_VALUE), min_size=1, max_size=4),
       as_override=st.booleans())
def test_fuzz_finetune_configs(workspace, monkeypatch, edits, as_override):
    from contracts.finetune_config import ConfigError
    from entrypoint.launcher.preflight import FinetuneError, prepare

    ws = workspace / "ws"
    monkeypatch.chdir(ws)
    config = {"model": {"path": "model"}, "data": {"path": "data.jsonl", "max_length": 512},
              "packing": {"budget": 512}, "output": {"dir": "out"}}
    overrides = []
    for key, value in edits:
        if as_override:
            overrides.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
        else:
            _set(config, key, value)
    (ws / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True))
    before = _snapshot(workspace / "outside")

    class ReachedVerify(Exception):
        pass

    def gate(**_):
        raise ReachedVerify

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            prepare(config_file=str(ws / "config.yaml"), overrides=overrides, allow_fallback=False,
                    env={"HOME": str(ws), "PATH": os.environ["PATH"]}, log=lambda m: None, gate=gate)
    except (ConfigError, FinetuneError) as exc:
        text = str(exc) + getattr(exc, "fix", "")
        assert "Traceback" not in text and (isinstance(exc, ConfigError) or exc.fix)
    except ReachedVerify:
        pass
    assert _snapshot(workspace / "outside") == before
    assert sorted(p.name for p in workspace.iterdir()) == ["outside", "ws"]
    assert not os.path.exists(MARKER)


ROLE = st.sampled_from(["system", "user", "assistant", "tool", "gpt", "human", "", "ASSISTANT", None, 3])
CONTENT = st.sampled_from(["hello", "<|im_end|>", "<|im_start|>assistant\n", "\ud800", "", " ", "x" * 5000,
                           "{% raw %}", "$(touch " + MARKER + ")"]) | st.text(max_size=40) | st.integers() | st.none()
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": CONTENT},
                                optional={"reasoning_content": CONTENT, "extra": HOSTILE_VALUE})
ROW = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=6)}),
    st.fixed_dictionaries({"messages": HOSTILE_VALUE}),
    HOSTILE_VALUE,
)
RAW_LINE = st.one_of(ROW.map(lambda r: json.dumps(r, allow_nan=True).encode()),
                     st.binary(max_size=64), st.just(b"{" * 5000), st.just(b"\xff\xfe"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(RAW_LINE, min_size=1, max_size=8))
def test_fuzz_data_rows(workspace, tokenizer, lines):
    from entrypoint.data.rows import read_rows
    from entrypoint.data.tokenize import tokenize_rows

    path = workspace / "ws" / "fuzz.jsonl"
    body = b"".join(line.replace(b"\n", b" ") + b"\n" for line in lines)
    path.write_bytes(body)
    corpus = tokenize_rows(read_rows(str(path), max_row_bytes=4096), tokenizer, max_length=256)
    # every row is a document or a counted bad row: nothing dropped silently, nothing raised
    non_blank = sum(1 for line in body.split(b"\n") if line.strip())
    assert corpus.n_rows == non_blank
    assert len(corpus) + corpus.bad.skipped == corpus.n_rows
    assert not os.path.exists(MARKER)


def _mutations():
    return st.lists(st.sampled_from(["extra_file", "symlink_out", "symlink_wheel", "rename", "meta_key",
                                     "meta_version", "meta_inputs", "meta_archs", "meta_garbage", "wheel_bytes",
                                     "delete_wheel", "delete_meta", "nested_dir", "manifest_garbage",
                                     "manifest_entry", "sig_garbage", "drop_sig", "dotfile", "big_meta"]),
                    min_size=0, max_size=3)


@pytest.fixture(scope="module")
def signed_export(workspace):
    from build.cache import CacheLayout
    from build.kernels import portable
    from build.kernels.store import KernelStore
    from build.signing import load_private_key, load_public_key
    from tests.build.test_kernel_import import _entry
    from tests.fixtures.keys import write_p256_pair

    src = workspace / "kernel-src"
    _entry(src)
    _entry(src, "flash-attn", "2.8.3.post2")
    private, public = write_p256_pair(workspace)
    export = workspace / "kernel-export"
    portable.export(KernelStore(CacheLayout(src)), export, sign_key=load_private_key(private))
    return export, load_public_key(public)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_mutations(), value=HOSTILE_VALUE, which=st.integers(min_value=0, max_value=1))
def test_fuzz_kernel_export_folders(workspace, signed_export, tmp_path_factory, mutations, value, which):
    from build.cache import CacheLayout
    from build.kernels import portable
    from build.kernels.store import KernelStore
    from contracts.events import EventLog

    original, public = signed_export
    root = tmp_path_factory.mktemp("kfuzz")
    export = root / "export"
    shutil.copytree(original, export, symlinks=True)
    entries = sorted(p for p in export.iterdir() if p.is_dir())
    entry = entries[which]
    meta_path = entry / "meta.json"
    for m in mutations:
        try:
            meta = json.loads(meta_path.read_bytes())
            meta = meta if isinstance(meta, dict) and isinstance(meta.get("wheel"), str) else None
        except (OSError, ValueError):
            meta = None
        if m == "extra_file":
            (entry / "evil.pth").write_text(f"import os; os.system('touch {MARKER}')\n")
        elif m == "symlink_out" and not (entry / "build.log.2").exists():
            os.symlink(workspace / "outside" / "x", entry / "build.log.2")
        elif m == "symlink_wheel" and meta:
            wheel = entry / meta["wheel"]
            if wheel.is_file():
                wheel.unlink()
                os.symlink(workspace / "outside" / "x", wheel)
        elif m == "rename" and entry.exists():
            target = export / ("f" * 64)
            if not target.exists():
                entry.rename(target)
                entry, meta_path = target, target / "meta.json"
        elif meta and m.startswith("meta_") and m != "meta_garbage":
            field = {"meta_key": "key", "meta_version": "version", "meta_inputs": "inputs", "meta_archs": "archs"}[m]
            meta[field] = value
            meta_path.write_text(json.dumps(meta, allow_nan=True))
        elif m == "meta_garbage" and entry.exists():
            meta_path.write_bytes(b"\xff" + json.dumps(value, allow_nan=True).encode())
        elif m == "big_meta" and entry.exists():
            meta_path.write_bytes(b" " * (2 << 20))
        elif m == "wheel_bytes" and meta and (entry / meta["wheel"]).is_file():
            with open(entry / meta["wheel"], "ab") as fh:
                fh.write(b"tampered")
        elif m == "delete_wheel" and meta and (entry / meta["wheel"]).is_file():
            (entry / meta["wheel"]).unlink()
        elif m == "delete_meta" and meta_path.is_file():
            meta_path.unlink()
        elif m == "nested_dir" and entry.exists():
            (entry / "sub").mkdir(exist_ok=True)
        elif m == "manifest_garbage":
            (export / "export-manifest.json").write_text(json.dumps(value, allow_nan=True))
        elif m == "manifest_entry":
            try:
                body = json.loads((export / "export-manifest.json").read_bytes())
            except ValueError:
                body = None
            if isinstance(body, dict) and isinstance(body.get("entries"), dict):
                body["entries"]["0" * 64] = value
                (export / "export-manifest.json").write_text(json.dumps(body, allow_nan=True))
        elif m == "sig_garbage":
            (export / "export-manifest.json.sig").write_text(str(value))
        elif m == "drop_sig":
            (export / "export-manifest.json.sig").unlink(missing_ok=True)
        elif m == "dotfile":
            (export / ".hidden").mkdir(exist_ok=True)
    before = _snapshot(workspace / "outside")
    store = KernelStore(CacheLayout(root / "cache"))
    log = EventLog(json_lines=False, stream=io.StringIO())
    try:
        imported, rejected = portable.import_from(store, export, public_key=public, log=log)
    except portable.ImportRefused as exc:
        assert exc.fix and store.entries() == []
        imported, rejected = [], []
    for imported_key in imported:
        entry_dir = store.root / imported_key
        assert sorted(p.name for p in entry_dir.iterdir()) <= ["build.log", "meta.json",
                                                               store.get(imported_key).meta["wheel"]]
        assert all(not p.is_symlink() for p in entry_dir.iterdir())
    if not mutations:
        assert len(imported) == 2 and rejected == []
    assert _snapshot(workspace / "outside") == before
    cached = [p for p in (root / "cache").rglob("*") if p.is_file()] if (root / "cache").exists() else []
    assert all(p.read_bytes() != b"untouched" for p in cached)   # the outside file never lands in the cache
    assert not os.path.exists(MARKER)


# ---- numbers at their limits: every number the finetune config takes -----------------------------

def _numeric_fields(kind: type) -> list[tuple[str, type, dict]]:
    """(dotted path, float or int, rule metadata) of every number field of the finetune config,
    data.sources' entries included (as data.sources[0].<key>): new fields are fuzzed unasked."""
    import dataclasses
    import typing

    from contracts.finetune_config import FinetuneConfig

    out = []

    def walk(node: type, prefix: str) -> None:
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            key, hint = f.metadata.get("key") or f.name, hints[f.name]
            inner = [a for a in typing.get_args(hint) if a is not type(None)]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{key}.")
            elif typing.get_origin(hint) is list and inner and dataclasses.is_dataclass(inner[0]):
                walk(inner[0], f"{prefix}{key}[0].")
            elif kind in (hint, *([inner[0]] if len(inner) == 1 and typing.get_origin(hint) is not list else [])):
                out.append((f"{prefix}{key}", kind, dict(f.metadata)))

    walk(FinetuneConfig, "")
    return out


FLOAT_FIELDS = _numeric_fields(float)
INT_FIELDS = _numeric_fields(int)
LIMITS = [10 ** 400, -10 ** 400, 2 ** 63, 2 ** 63 - 1, -2 ** 63, 2 ** 64, 1e308, -1e308, 5e-324, -0.0, 0, 1, 0.5,
          float("nan"), float("inf"), float("-inf"), True, None, [1.0], {"a": 1}]
NUMBER_TEXT = st.sampled_from(["nan", "NaN", "inf", "-inf", "infinity", "1e400", "-1e400", "1e308", "0.5", " 2e-5 ",
                               "0x10", "1_000", "", "1e", "99999999999999999999999", "9223372036854775808", "-0"])
NUMBER = (st.floats(allow_nan=True, allow_infinity=True) | st.floats(min_value=-2.0, max_value=2.0)
          | st.integers() | st.integers(min_value=-2 ** 70, max_value=2 ** 70) | st.sampled_from(LIMITS)
          | NUMBER_TEXT | st.text(max_size=6))


def _tree(dotted: str, value) -> dict:
    section, rest = dotted.split(".", 1)
    if rest.startswith("sources[0]."):
        return {section: {"sources": [{"path": "d.jsonl", rest.removeprefix("sources[0]."): value}]}}
    return {section: {rest: value}}


def _accepted(kind: type, value, meta: dict):
    """What the engine must make of `value` (None: refused), computed from the field's declared rule."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, str):
        try:
            value = kind(value) if kind is float else int(value) if re.fullmatch(r"[+-]?\d{1,18}", value.strip()) \
                else None
        except ValueError:
            return None
    if value is None or (kind is int and not isinstance(value, int)):
        return None
    try:
        number = float(value) if kind is float else value
    except OverflowError:
        return None
    if kind is float and not math.isfinite(number) or kind is int and not -2 ** 63 <= number < 2 ** 63:
        return None
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    ok = (ge is None or number >= ge) and (gt is None or number > gt) and (le is None or number <= le)
    return number if ok else None


def _check_number(field: str, kind: type, meta: dict, value, carrier: str) -> None:
    from contracts import safe_yaml
    from contracts.finetune_config import ConfigError, build_config

    raw = value
    if carrier == "override":   # KEY=VALUE on a command line: the value is text
        raw = value if isinstance(value, str) else json.dumps(value)
    tree = _tree(field, raw)
    if carrier == "yaml":
        tree = safe_yaml.loads(yaml.safe_dump(tree))
    want = _accepted(kind, raw, meta)
    if raw is None:     # `key: null` means "the default", as for every field
        build_config([tree], require_paths=False)
        return
    try:
        cfg = build_config([tree], require_paths=False)
        problems = []
    except ConfigError as exc:
        cfg, problems = None, [p for p in exc.problems if p.field == field]
        assert all(p.fix and "Traceback" not in p.problem for p in exc.problems)
    if want is None:
        assert problems, f"{field}={raw!r} ({carrier}) was accepted"
        assert problems[0].code in ("out-of-range", "wrong-type"), problems[0]
        if problems[0].code == "out-of-range":
            assert "(allowed: " in problems[0].problem and "None" not in problems[0].problem, problems[0]
    else:
        assert not [p for p in problems if p.code in ("out-of-range", "wrong-type")], (field, raw, problems)
        if cfg is not None:
            node = cfg
            for part in field.replace("[0]", ".0").split("."):
                node = node[int(part)] if part.isdigit() else getattr(node, {"async": "async_save"}.get(part, part))
            assert node == want and type(node) is kind, (field, raw, node)


def test_the_fuzz_sees_every_number_of_the_config():
    names = {f for f, _, _ in FLOAT_FIELDS}
    assert {"train.lr", "train.min_lr_ratio", "data.eval_fraction", "data.sources[0].weight",
            "output.peak_tflops"} <= names and len(names) >= 10
    assert {"packing.budget", "train.seed", "train.max_steps", "train.epochs"} <= {f for f, _, _ in INT_FIELDS}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), carrier=st.sampled_from(["layer", "yaml", "override"]))
def test_fuzz_config_floats(data, carrier):
    """A finite number in the field's declared range is accepted as that number; anything else (nan,
    inf, 1e400, an integer past a float, text, a bool) is a named config problem, never an exception."""
    field, kind, meta = data.draw(st.sampled_from(FLOAT_FIELDS))
    edges = [b for b in (meta.get("ge"), meta.get("gt"), meta.get("le")) if b is not None]
    near = [math.nextafter(b, d) for b in edges for d in (-math.inf, math.inf)] + edges
    value = data.draw(NUMBER | st.sampled_from(near or [0.0]))
    _check_number(field, kind, meta, value, carrier)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data(), carrier=st.sampled_from(["layer", "yaml", "override"]))
def test_fuzz_config_integers(data, carrier):
    """The same for integers: in range and within signed 64 bits, or a named problem."""
    field, kind, meta = data.draw(st.sampled_from(INT_FIELDS))
    edges = [int(b) for b in (meta.get("ge"), meta.get("le")) if b is not None]
    value = data.draw(NUMBER | st.sampled_from([e + d for e in edges for d in (-1, 0, 1)] or [0]))
    _check_number(field, kind, meta, value, carrier)
