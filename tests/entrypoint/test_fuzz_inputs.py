"""Hypothesis fuzz of the job's inputs, in-process (no CLI spawns): finetune configs, data rows and
kernel export folders. Same assertions as the spec fuzz: a clean verdict (accepted, or refused
with the field and a fix; 3 for a refused import), no traceback, nothing outside the workspace
touched, no code run."""
from __future__ import annotations

import contextlib
import io
import json
import os
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
