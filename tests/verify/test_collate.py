import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.collate import Document, collate_packed, collate_unpacked

pytestmark = pytest.mark.unit


def doc(n, start=1):
    ids = list(range(start, start + n))
    return Document(input_ids=ids, labels=list(ids))


def test_packed_row_layout_with_dummy():
    out = collate_packed([doc(3), doc(2, 10)], budget=8, pad_token_id=0)
    assert out["input_ids"].tolist() == [[1, 2, 3, 10, 11, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 11, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert out["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    assert torch.equal(out["cu_seq_lens_q"], out["cu_seq_lens_k"])
    assert out["max_length_q"] == out["max_length_k"] == 3
    assert type(out["max_length_q"]) is int
    assert out["input_ids"].dtype == out["labels"].dtype == out["position_ids"].dtype == torch.int64
    assert out["seq_idx"].dtype == out["cu_seq_lens_q"].dtype == torch.int32


def test_exact_fit_has_no_dummy():
    out = collate_packed([doc(3), doc(2)], budget=5, pad_token_id=0)
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert out["seq_idx"].tolist() == [[0, 0, 0, 1, 1]]


def test_existing_label_masks_are_kept():
    d = Document(input_ids=[5, 6, 7], labels=[-100, -100, 7])
    assert collate_packed([d], budget=3, pad_token_id=0)["labels"].tolist() == [[-100, -100, 7]]


@pytest.mark.parametrize("docs, budget, message", [
    ([doc(5), doc(4)], 8, "9 tokens but the row budget is 8"),
    ([Document(input_ids=[1, 2], labels=[1])], 4, "2 input_ids but 1 labels"),
    ([Document(input_ids=[], labels=[])], 4, "document 0 is empty"),
    ([], 4, "no documents"),
])
def test_bad_input_names_problem_and_fix(docs, budget, message):
    with pytest.raises(ValueError, match=message):
        collate_packed(docs, budget=budget, pad_token_id=0)


def test_unpacked_reference():
    out = collate_unpacked(doc(4))
    assert out["input_ids"].tolist() == [[1, 2, 3, 4]]
    assert out["labels"].tolist() == [[-100, 2, 3, 4]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]]


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6), pad=st.integers(0, 10))
def test_packed_is_consistent_for_any_lengths(lengths, pad):
    docs = [doc(n) for n in lengths]
    budget = sum(lengths) + pad
    out = collate_packed(docs, budget=budget, pad_token_id=0)
    cu = out["cu_seq_lens_q"].tolist()
    n_segments = len(lengths) + (1 if pad else 0)
    assert len(cu) == n_segments + 1 and cu[0] == 0 and cu[-1] == budget
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        assert out["position_ids"][0, s:e].tolist() == list(range(e - s))
        assert set(out["seq_idx"][0, s:e].tolist()) == {i}
        assert out["labels"][0, s] == -100
    assert out["max_length_q"] == max(b - a for a, b in zip(cu, cu[1:]))
    if pad:
        assert (out["labels"][0, cu[-2]:] == -100).all()
