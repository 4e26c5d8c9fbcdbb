"""Data through `datasets`: files, folders, globs, save_to_disk, ultrachat_200k as the Hub lays it out, five row
schemas with golden masks, reasoning_content, weighted mixtures, held-out splits, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.finetune_config import build_config
from entrypoint.data.inspect_data import runs
from tests.fixtures.chat import run_entrypoint

pytestmark = pytest.mark.unit


def _cfg(**data):
    return build_config([{"model": {"path": "m"}, "data": {"max_length": 512, **data}, "packing": {"budget": 512}}])


def _trained(tokenizer, corpus) -> list[list[str]]:
    """Each document's trained spans, decoded (the first token of a document never carries loss)."""
    out = []
    for i in range(len(corpus)):
        ids, labels = corpus.doc_tokens(i), corpus.doc_labels(i)
        out.append([tokenizer.decode(ids[a:b].tolist()) for a, b, trained in runs(labels) if trained])
    return out


def _load(tmp_path, tokenizer, **data):
    from entrypoint.data.corpus_build import load_corpus

    return load_corpus(_cfg(**data), tokenizer, cache_dir=tmp_path / "cache")


# ---- golden masks, one 8-row file per schema ----------------------------------------------------

WORDS = ["red", "blue", "tree", "river", "sun", "moon", "cat", "dog"]


def _schema_rows(schema: str) -> tuple[list[dict], list[list[str]]]:
    rows, golden = [], []
    for i in range(8):
        a, b = WORDS[i], WORDS[(i + 3) % 8]
        if schema == "messages":
            rows.append({"messages": [{"role": "user", "content": f"{a} {b}"},
                                      {"role": "assistant", "content": f"{b} {a}"}]})
            golden.append([f"{b} {a}<|im_end|>"])
        elif schema == "sharegpt":
            rows.append({"conversations": [{"from": "system", "value": "be short"}, {"from": "human", "value": a},
                                           {"from": "gpt", "value": b}, {"from": "human", "value": b},
                                           {"from": "gpt", "value": a}]})
            golden.append([f"{b}<|im_end|>", f"{a}<|im_end|>"])
        elif schema == "alpaca":
            rows.append({"instruction": f"say {a}", "input": b if i % 2 else "", "output": f"{a} {b}"})
            golden.append([f"{a} {b}<|im_end|>"])
        elif schema == "text":
            rows.append({"text": f"{a} {b} {a}"})
            golden.append([f"{a} {b} {a}<|im_end|>"])   # all of it, and the end-of-sequence token
        else:
            rows.append({"prompt": f"{a} is", "completion": f" {b}"})
            golden.append([f" {b}<|im_end|>"])
    return rows, golden


@pytest.mark.parametrize("schema", ["messages", "sharegpt", "alpaca", "text", "prompt_completion"])
def test_each_schema_gives_zero_bad_rows_and_the_golden_mask(tokenizer, tmp_path, schema):
    rows, golden = _schema_rows(schema)
    path = tmp_path / f"{schema}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = _load(tmp_path, tokenizer, path=str(path), schema=schema)
    assert corpus.bad.skipped == 0 and len(corpus) == 8
    assert _trained(tokenizer, corpus) == golden


def test_alpaca_renders_instruction_then_a_blank_line_then_the_input(tokenizer, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"instruction": "say it", "input": "red", "output": "red"}) + "\n")
    corpus = _load(tmp_path, tokenizer, path=str(path), schema="alpaca")
    text = tokenizer.decode(corpus.doc_tokens(0).tolist())
    assert "<|im_start|>user\nsay it\n\nred<|im_end|>" in text


def test_reasoning_is_trained_where_the_template_renders_it_and_counted_where_it_does_not(tmp_path, fixture_dir):
    from transformers import AutoTokenizer

    from tests.fixtures.chat import REASONING_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(str(fixture_dir.model_dir))
    tokenizer.chat_template = REASONING_TEMPLATE
    row = {"messages": [{"role": "user", "content": "red"},
                        {"role": "assistant", "content": "blue", "reasoning_content": "first thought"},
                        {"role": "user", "content": "tree"},
                        {"role": "assistant", "content": "river", "reasoning_content": "second thought"}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    from entrypoint.data.rows import read_rows
    from entrypoint.data.tokenize import tokenize_rows

    corpus = tokenize_rows(read_rows(str(path)), tokenizer)
    assert corpus.bad.skipped == 0 and corpus.bad.reasoning_dropped == 1   # the first turn's, before a user turn
    spans = _trained(tokenizer, corpus)[0]
    assert spans == ["blue<|im_end|>", "<think>\nsecond thought\n</think>\n\nriver<|im_end|>"]


# ---- where rows come from --------------------------------------------------------------------------

def _inspect(fixture_dir, *overrides: str, rows: int = 0):
    return run_entrypoint(["inspect-data", "--config", str(fixture_dir.config), *overrides, "--rows", str(rows),
                           "--json"], timeout=240)


@pytest.mark.slow
def test_inspect_data_reads_ultrachat_200k_as_the_hub_lays_it_out(fixture_dir, tmp_path):
    """data/train_sft-00000-of-00003-<16 hex>.parquet and the README's `configs:`: each split by name."""
    from tests.fixtures.hub_datasets import ultrachat_200k

    root = ultrachat_200k(tmp_path / "ultrachat_200k", rows_per_shard=4)
    for split, rows in (("train_sft", 12), ("test_sft", 4)):
        r = _inspect(fixture_dir, f"data.path={root}", f"data.split={split}", rows=rows)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout)
        assert out["summary"]["rows_read"] == rows and out["summary"]["documents"] == rows
        assert out["summary"]["bad_rows"] == {}
        spans = [span for doc in out["documents"] for span in doc["trained_spans"]]
        assert len(spans) == rows and all(span.endswith(f" {split}<|im_end|>") for span in spans), spans
    r = _inspect(fixture_dir, f"data.path={root}", "data.split=train")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "data.split 'train'" in r.stderr and "(it has: train_sft, test_sft, train_gen, test_gen)" in r.stderr
    fix = next(line for line in r.stderr.splitlines() if "fix:" in line)
    assert "train_sft" in fix and ".parquet" not in fix


def test_a_folder_without_readme_resolves_its_splits_by_datasets_patterns(tmp_path):
    from entrypoint.data.sources import DataError, resolve
    from tests.fixtures.hub_datasets import plain_shards

    root = plain_shards(tmp_path / "plain", {"train": 2, "test": 1})
    train = resolve(str(root), split="train")
    assert [Path(f).name for f in train.files] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert [Path(f).name for f in resolve(str(root), split="test").files] == ["test-00000-of-00001.parquet"]
    with pytest.raises(DataError) as info:
        resolve(str(root), split="validation")
    assert "(it has: train, test)" in str(info.value) and info.value.field == "data.split"
    flat = tmp_path / "flat"       # train.jsonl / test.jsonl: the split is in the file name
    flat.mkdir()
    for name in ("train.jsonl", "test.jsonl", "notes.txt"):
        (flat / name).write_text(json.dumps(_schema_rows("messages")[0][0]) + "\n")
    assert [Path(f).name for f in resolve(str(flat), split="test").files] == ["test.jsonl"]


def _hostile(root: Path, tmp_path: Path, case: str) -> None:
    import os

    from tests.fixtures.hub_datasets import ULTRACHAT_README

    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "stolen.parquet").write_bytes((next((root / "data").glob("test_sft-*"))).read_bytes())
    readme = root / "README.md"
    swap = {"dotdot": "../outside/*", "absolute": f"{outside}/*", "url": "hf://datasets/someone/else/*",
            "linked_dir": "ext/*"}
    if case in swap:
        readme.write_text(ULTRACHAT_README.replace("path: data/train_sft-*", f"path: {swap[case]}"))
    if case == "linked_dir":
        os.symlink(outside, root / "ext")
    elif case == "linked_file":
        os.symlink(outside / "stolen.parquet", root / "data" / "train_sft-00003-of-00003-0123456789abcdef.parquet")
    elif case == "anchors":
        readme.write_text(ULTRACHAT_README.replace("path: data/train_sft-*", "path: &p data/train_sft-*")
                          .replace("path: data/test_sft-*", "path: *p"))
    elif case == "unclosed":
        readme.write_text(ULTRACHAT_README.replace("\n---\n", "\n").replace("---\n", "---\n" + "#\n" * (1 << 19)))
    elif case == "fifo_readme":
        readme.unlink()
        os.mkfifo(readme)
    elif case == "not_a_list":
        readme.write_text("---\nconfigs: data/train_sft-*\n---\n")
    elif case == "two_configs":
        readme.write_text("---\nconfigs:\n- config_name: a\n  data_files: data/train_sft-*\n- config_name: b\n"
                          "  data_files: data/test_sft-*\n---\n")


@pytest.mark.parametrize("case, said", [
    ("dotdot", "leaves the dataset folder"), ("absolute", "leaves the dataset folder"),
    ("url", "leaves the dataset folder"), ("linked_dir", "is a link to"),
    ("linked_file", "is a link to"), ("anchors", "anchors and aliases"),
    ("unclosed", "no closing `---`"), ("fifo_readme", "not a regular file"),
    ("not_a_list", "not a list of mappings"), ("two_configs", "none is the default"),
])
def test_a_hostile_readme_is_refused_naming_the_field_and_reads_nothing_outside(tmp_path, case, said):
    from entrypoint.data.sources import DataError, resolve
    from tests.fixtures.hub_datasets import ultrachat_200k

    root = ultrachat_200k(tmp_path / "ds")
    _hostile(root, tmp_path, case)
    with pytest.raises(DataError) as info:
        resolve(str(root), split="train_sft", field="data.sources[1].path")
    assert said in str(info.value) and info.value.fix and info.value.field == "data.sources[1].path"


def test_a_split_of_a_file_or_a_glob_is_refused_naming_the_split_field(tmp_path):
    from entrypoint.data.sources import DataError, resolve
    from tests.fixtures.hub_datasets import ultrachat_200k

    root = ultrachat_200k(tmp_path / "ds")
    for path in (next((root / "data").glob("test_sft-*")), root / "data" / "*.parquet"):
        with pytest.raises(DataError) as info:
            resolve(str(path), split="test_sft", field="data.sources[0].path")
        assert info.value.field == "data.sources[0].split" and "dataset folder" in str(info.value)


@pytest.mark.parametrize("form", ["file", "folder", "glob", "disk", "arrow", "json_array"])
def test_every_path_form_reads_the_same_documents(tokenizer, tmp_path, form):
    import datasets

    rows, golden = _schema_rows("messages")
    src = tmp_path / "src"
    src.mkdir()
    if form in ("file", "folder", "glob"):
        for k in range(2):
            (src / f"part{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[k * 4:k * 4 + 4]))
        path = {"file": src / "part0.jsonl", "folder": src, "glob": src / "part*.jsonl"}[form]
        want = golden[:4] if form == "file" else golden
    elif form == "json_array":
        path = src / "rows.json"
        path.write_text(json.dumps(rows))
        want = golden
    else:
        ds = datasets.Dataset.from_list(rows)
        if form == "disk":
            ds.save_to_disk(str(src / "saved"))
            path = src / "saved"
        else:
            ds.to_parquet(str(src / "tmp.parquet"))
            arrow = datasets.Dataset.from_parquet(str(src / "tmp.parquet"))
            path = Path(arrow.cache_files[0]["filename"])
        want = golden
    corpus = _load(tmp_path, tokenizer, path=str(path))
    assert corpus.bad.skipped == 0 and sorted(map(tuple, _trained(tokenizer, corpus))) == sorted(map(tuple, want))


def test_a_rerun_reuses_the_tokenized_files_and_an_edit_retokenizes(tokenizer, tmp_path):
    rows, _ = _schema_rows("messages")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = _load(tmp_path, tokenizer, path=str(path))
    made = sorted(p.name for p in (tmp_path / "cache").glob("tokenized-*"))
    again = _load(tmp_path, tokenizer, path=str(path))
    assert sorted(p.name for p in (tmp_path / "cache").glob("tokenized-*")) == made and len(made) == 1
    assert again.fingerprint() == first.fingerprint()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    edited = _load(tmp_path, tokenizer, path=str(path))
    assert len(list((tmp_path / "cache").glob("tokenized-*"))) == 2 and len(edited) == 5
    assert edited.fingerprint() != first.fingerprint()


def test_the_corpus_is_memory_mapped_not_copied(tokenizer, tmp_path):
    rows, _ = _schema_rows("messages")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = _load(tmp_path, tokenizer, path=str(path))
    for shard in corpus.shards:
        assert not shard.tokens.flags.owndata and not shard.tokens.flags.writeable   # views into the mmap


# ---- mixtures and held-out data ------------------------------------------------------------------

def test_a_10000_document_mixture_gives_each_source_its_share(tokenizer, tmp_path):
    from entrypoint.data.corpus import read_corpus
    from entrypoint.data.corpus_build import build

    sizes, weights = (6000, 3000, 1000), (1.0, 1.0, 2.0)
    sources = []
    for s, n in enumerate(sizes):
        path = tmp_path / f"s{s}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{WORDS[s]} {i}"}) + "\n" for i in range(n)))
        sources.append({"path": str(path), "weight": weights[s]})
    said: list[str] = []
    cfg = build_config([{"model": {"path": "m"}, "data": {"sources": sources, "schema": "text", "max_length": 64},
                         "packing": {"budget": 64}}])
    built = build(cfg, tokenizer, tmp_path / "cache", log=said.append)
    corpus = read_corpus(built.train)
    assert len(corpus) == 10000
    first_words = np.array([tokenizer.decode(corpus.doc_tokens(i)[:1].tolist()).strip() for i in range(len(corpus))])
    for s, weight in enumerate(weights):
        share = float(np.mean(first_words == WORDS[s]))
        assert abs(share - weight / sum(weights)) <= 0.02, (s, share)
    assert any("runs 5 passes" in line for line in said)   # 1000 documents fill a 50% share of 10000


def test_tokenizing_that_fails_leaves_no_staging_folder_in_the_cache(tokenizer, tmp_path, monkeypatch):
    """The corpus is published whole or not at all: an error (or a stop) inside Dataset.map removes
    the half-written .tmp-tokenized-* folder, and a rerun publishes the corpus."""
    from entrypoint.data import tokenize
    from entrypoint.data.sources import resolve

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _schema_rows("messages")[0]))
    cache, source, data = tmp_path / "cache", resolve(str(path)), _cfg(path=str(path)).data

    def broken(*_args, **_kwargs):
        raise RuntimeError("the tokenizer broke")

    with monkeypatch.context() as patch:
        patch.setattr(tokenize, "tokenize_batch", broken)
        with pytest.raises(RuntimeError, match="the tokenizer broke"):
            tokenize.tokenize_source(source, tokenizer, data, cache, schema="messages")
    assert [p.name for p in cache.iterdir()] == ["raw"]   # datasets' row cache; no corpus, whole or half
    done = tokenize.tokenize_source(source, tokenizer, data, cache, schema="messages")
    assert done["n_rows"] == 8
    assert sorted(p.name for p in cache.iterdir()) == ["raw", f"tokenized-{done['fingerprint']}"]


# Garbage the parent has not collected yet (here a torch gloo process group in a reference cycle,
# which a test or a user's own loop can leave behind) when Dataset.map forks its workers; a worker
# that collects it runs the group's destructor, which needs gloo's threads: they exist only in the
# parent, so the worker hung for ever or died, and the map with it.
FORKED_GARBAGE = r"""
import gc, json, sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoTokenizer

from contracts.finetune_config import build_config
from entrypoint.data import tokenize
from entrypoint.data.sources import resolve

model_dir, tmp = sys.argv[1], Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
path = tmp / "d.jsonl"
path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(1024)))
cfg = build_config([{"model": {"path": "m"}, "packing": {"budget": 64},
                     "data": {"path": str(path), "schema": "text", "max_length": 64, "num_proc": 2}}])
original = tokenize.tokenize_batch

def collecting_batch(*args, **kwargs):
    gc.collect()          # a worker's collector runs while it tokenizes
    return original(*args, **kwargs)

tokenize.tokenize_batch = collecting_batch
gc.disable()              # keep the cycle uncollected until the fork, as a busy parent does
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
cycle = [dist.group.WORLD]
cycle.append(cycle)
dist.destroy_process_group()
del cycle
done = tokenize.tokenize_source(resolve(str(path)), tokenizer, cfg.data, tmp / "cache", schema="text")
print("tokenized", done["n_rows"])
"""


@pytest.mark.slow
def test_forked_tokenizer_workers_never_collect_what_the_parent_left_behind(fixture_dir, tmp_path):
    import subprocess
    import sys

    from build.spec import REPO_ROOT

    proc = subprocess.run([sys.executable, "-c", FORKED_GARBAGE, str(fixture_dir.model_dir), str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "tokenized 1024"


def test_eval_fraction_holds_out_whole_documents_deterministically(tokenizer, tmp_path):
    from entrypoint.data.corpus import read_corpus
    from entrypoint.data.corpus_build import build

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"{WORDS[i % 8]} number {i}"}) + "\n" for i in range(200)))
    cfg = build_config([{"model": {"path": "m"}, "data": {"path": str(path), "schema": "text", "max_length": 64,
                                                          "eval_fraction": 0.1}, "packing": {"budget": 64}}])
    a = build(cfg, tokenizer, tmp_path / "cache", log=lambda m: None)
    b = build(cfg, tokenizer, tmp_path / "cache", log=lambda m: None)
    train, held = read_corpus(a.train), read_corpus(a.eval)
    assert len(train) == 180 and len(held) == 20
    assert set(train.rows.tolist()).isdisjoint(held.rows.tolist())
    assert read_corpus(b.eval).rows.tolist() == held.rows.tolist()


# ---- bad input: exit 2 with the field and the fix, before any rank starts ----------------------------

@pytest.mark.parametrize("overrides, field", [
    (["data.path={empty}"], "data.path"),
    (["data.path={root}/nothing*.jsonl"], "data.path"),
    (["data.path={mixed}"], "data.path"),
    (["data.eval_fraction=0.7"], "data.eval_fraction"),
    (["data.eval_fraction=0"], None),                               # 0 = none: not an error
    (["data.path={ultra}", "data.split=valid"], "data.split"),
])
def test_bad_data_sources_are_exit_2_naming_the_field(fixture_dir, tmp_path, overrides, field):
    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text(json.dumps(_schema_rows("messages")[0][0]) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_schema_rows("messages")[0]), tmp_path / "mixed" / "b.parquet")
    from tests.fixtures.hub_datasets import ultrachat_200k

    ultra = ultrachat_200k(tmp_path / "ultra")
    filled = [o.format(empty=tmp_path / "empty", root=tmp_path, mixed=tmp_path / "mixed", ultra=ultra)
              for o in overrides]
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), f"output.dir={tmp_path / 'out'}",
                        "--print-config" if field is None else "--dry-run", *filled], timeout=240)
    if field is None:
        assert r.returncode == 0, r.stderr[-2000:]
        return
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert field in r.stderr and "fix:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / ".launch").exists()     # refused before any plan was written


def test_a_weight_that_is_not_positive_is_exit_2(fixture_dir, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"model": {"path": str(fixture_dir.model_dir)},
                                  "data": {"sources": [{"path": str(fixture_dir.data), "weight": 0},
                                                       {"path": str(fixture_dir.data), "weight": -1}]}}))
    r = run_entrypoint(["finetune", "--config", str(config), f"output.dir={tmp_path / 'out'}"], timeout=120)
    assert r.returncode == 2 and "data.sources[0].weight" in r.stderr and "data.sources[1].weight" in r.stderr
    assert "Traceback" not in r.stderr


def test_weights_at_the_float_limits_share_the_documents_as_equal_weights_do(tokenizer, tmp_path):
    """Two weights of 1e308 sum to inf in floats: every document must still be trained on."""
    from entrypoint.data.corpus import read_corpus
    from entrypoint.data.corpus_build import build, quotas

    sources = []
    for s in range(2):
        path = tmp_path / f"s{s}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{WORDS[s]} {i}"}) + "\n" for i in range(150)))
        sources.append({"path": str(path), "weight": 1e308})
    cfg = build_config([{"model": {"path": "m"}, "data": {"sources": sources, "schema": "text", "max_length": 64},
                         "packing": {"budget": 64}}])
    corpus = read_corpus(build(cfg, tokenizer, tmp_path / "cache", log=lambda m: None).train)
    assert len(corpus) == 300 and len(set(corpus.rows.tolist())) == 150   # 150 rows from each source
    assert quotas([150, 150], [5e-324, 5e-324]) == [150, 150] and quotas([3, 3], [1e308, 5e-324]) == [6, 0]


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.tuples(st.integers(0, 10 ** 6), st.floats(min_value=5e-324, max_value=1.7976931348623157e308)),
                      min_size=1, max_size=6))
def test_quotas_share_every_document_by_weight_for_any_finite_positive_weights(parts):
    from fractions import Fraction

    from entrypoint.data.corpus_build import quotas

    sizes, weights = [n for n, _ in parts], [w for _, w in parts]
    counts = quotas(sizes, weights)
    total, scale = sum(sizes), sum(Fraction(w) for w in weights)
    assert sum(counts) == total and all(c >= 0 for c in counts)
    assert all(abs(c - Fraction(w) * total / scale) < 1 for c, w in zip(counts, weights))
