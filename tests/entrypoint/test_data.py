"""Chat rows -> documents: assistant-only masking token by token, and bad-row accounting."""
from __future__ import annotations

import json

import numpy as np
import pytest

from contracts.collate import IGNORE_INDEX as IGNORE
from entrypoint.data.rows import read_rows
from entrypoint.data.sources import DataError
from entrypoint.data.tokenize import tokenize_rows, validate_row

pytestmark = pytest.mark.unit


def _expected(tokenizer, segments: list[tuple[str, bool]]):
    """Oracle independent of data.py: tokenize each template segment on its own and mark
    the assistant ones. Segments end at special tokens/newlines, where byte-level BPE
    never merges across, so the concatenation must equal the full tokenization."""
    ids, labels = [], []
    for text, in_loss in segments:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        labels += seg if in_loss else [IGNORE] * len(seg)
    return ids, labels


def _corpus(tokenizer, rows, **kw):
    return tokenize_rows(iter(enumerate(rows)), tokenizer, **kw)


def test_assistant_only_masking_token_by_token(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "red blue"},
        {"role": "assistant", "content": "blue red ."},
        {"role": "user", "content": "one two three"},
        {"role": "assistant", "content": "three two one ."},
    ]
    segments = [
        ("<|im_start|>system\nbe brief<|im_end|>\n", False),
        ("<|im_start|>user\nred blue<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("blue red .<|im_end|>", True),          # reply + end-of-turn in the loss
        ("\n", False),                             # template newline after <|im_end|> is not
        ("<|im_start|>user\none two three<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("three two one .<|im_end|>", True),
        ("\n", False),
    ]
    want_ids, want_labels = _expected(tokenizer, segments)
    corpus = _corpus(tokenizer, [{"messages": messages}])
    assert len(corpus) == 1 and corpus.bad.skipped == 0
    assert corpus.tokens.tolist() == want_ids
    got = corpus.labels.tolist()
    for i, (g, w) in enumerate(zip(got, want_labels)):
        assert g == w, f"token {i} ({tokenizer.decode([want_ids[i]])!r}): label {g}, want {w}"
    assert len(got) == len(want_labels)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # exactly the two assistant end-of-turn tokens are in the loss, not the user/system ones
    assert sum(1 for t, lab in zip(want_ids, got) if t == im_end and lab != IGNORE) == 2
    assert sum(1 for t in want_ids if t == im_end) == 5  # system, 2 user, 2 assistant


def test_user_text_equal_to_reply_is_not_trained_on(tokenizer):
    # the reply text also occurs earlier, in the user turn: the span must be the later one
    messages = [{"role": "user", "content": "cat dog"}, {"role": "assistant", "content": "cat dog"}]
    corpus = _corpus(tokenizer, [{"messages": messages}])
    text = tokenizer.decode(corpus.tokens[corpus.labels != IGNORE].tolist())
    assert text == "cat dog<|im_end|>"
    first_label = int(np.argmax(corpus.labels != IGNORE))
    assert "assistant" in tokenizer.decode(corpus.tokens[:first_label].tolist())


GOOD = {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "b a ."}]}


def test_bad_rows_counted_per_reason_never_dropped_silently(tokenizer, tmp_path):
    lines = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({"prompt": "no messages"}),
        json.dumps({"messages": "a string"}),
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps([1, 2]),
        json.dumps(GOOD),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    corpus = tokenize_rows(read_rows(str(path)), tokenizer)
    assert len(corpus) == 2 and corpus.n_rows == 11
    assert corpus.bad.counts == {
        "invalid_json": 1, "missing_messages": 1, "messages_not_a_list": 1, "empty_messages": 1,
        "malformed_message": 1, "unknown_role": 1, "empty_content": 1, "no_assistant_turn": 1,
        "not_an_object": 1,
    }
    assert corpus.bad.examples["invalid_json"] == [1]
    assert len(corpus) + corpus.bad.skipped == corpus.n_rows  # every row accounted for
    assert corpus.rows.tolist() == [0, 10]


def test_overlong_policy_skip_and_truncate(tokenizer):
    long_reply = " ".join(["tree"] * 200)
    rows = [GOOD, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": long_reply}]},
            {"messages": [{"role": "user", "content": long_reply}, {"role": "assistant", "content": "y"}]}]
    skip = _corpus(tokenizer, rows, max_length=64, overlong="skip")
    assert len(skip) == 1 and skip.bad.counts == {"overlong": 2} and skip.bad.truncated == 0
    trunc = _corpus(tokenizer, rows, max_length=64, overlong="truncate")
    # row 1 keeps a truncated reply; row 2's reply is cut away entirely, so it has no loss
    assert len(trunc) == 2 and trunc.bad.truncated == 1
    assert trunc.bad.counts == {"overlong_no_loss_after_truncation": 1}
    assert trunc.lengths.max() == 64


def test_parquet_rows(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, GOOD, {"messages": []}]), path)
    corpus = tokenize_rows(read_rows(str(path)), tokenizer)
    assert len(corpus) == 2 and corpus.bad.counts == {"empty_messages": 1}


def test_missing_file_is_a_clear_error():
    with pytest.raises(DataError, match="does not exist") as err:
        list(read_rows("/nonexistent/data.jsonl"))
    assert "data.path" in err.value.fix


def test_validate_row_keeps_only_role_and_content():
    messages, reason = validate_row({"messages": [{"role": "user", "content": "a", "extra": 1},
                                                  {"role": "assistant", "content": "b"}]}, "messages")
    assert reason == "" and messages[0] == {"role": "user", "content": "a"}


def test_a_row_with_too_many_messages_is_refused_before_it_is_rendered(tokenizer, tmp_path):
    """200,000 tiny messages in one row cost GBs to render; the cap counts it as a bad row first."""
    import json

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(200_000)]
    path = tmp_path / "rows.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps(good) + "\n")
    corpus = tokenize_rows(read_rows(str(path), max_row_bytes=8 << 20), tokenizer, max_messages=4096)
    assert corpus.bad.counts == {"too_many_messages": 1} and len(corpus) == 1


def test_a_parquet_row_group_over_the_cap_is_refused_unread(tmp_path):
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": os.urandom(2000).hex()}, {"role": "assistant", "content": "b"}]}
            for _ in range(400)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "big.parquet", row_group_size=400)
    with pytest.raises(DataError, match="row group 0 is .* over data.max_row_group_bytes") as info:
        next(read_rows(str(tmp_path / "big.parquet"), max_row_group_bytes=1 << 20))
    assert "row_group_size" in info.value.fix
    assert len(list(read_rows(str(tmp_path / "big.parquet"), max_row_group_bytes=1 << 30))) == 400
