"""Packing schemes, the sampler, and packed/padded micro-batches field by field."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.collate import IGNORE_INDEX as IGNORE
from entrypoint.data.packing import batch_area, lower_bound, pack_bfd, pack_greedy, pack_padded, pack_windows
from entrypoint.data.sampler import PackedSampler, SamplerStateError
from entrypoint.data.tokenize import BadRows, Corpus

pytestmark = pytest.mark.unit


def test_bfd_hand_case_is_optimal_where_greedy_is_not():
    lengths = [6, 5, 4, 5, 4, 6]          # perfect packing: (6,4) (6,4) (5,5)
    bins = pack_bfd(lengths, 10)
    assert sorted(sorted(lengths[i] for i in b) for b in bins) == [[4, 6], [4, 6], [5, 5]]
    assert pack_greedy(lengths, 10) == [[0], [1, 2], [3, 4], [5]]   # next-fit: 6 | 5 4 | 5 4 | 6
    assert lower_bound(np.array(lengths), 10) == 3


def test_greedy_is_next_fit_in_order():
    assert pack_greedy([3, 3, 3, 5], 10) == [[0, 1, 2], [3]]
    assert pack_greedy([6, 5, 4], 10) == [[0], [1, 2]]


def test_padded_is_rectangle_bounded():
    lengths = [4, 2, 3, 9, 1]
    bins = pack_padded(lengths, 10)
    # [4,2] is a 2x4 rectangle; adding 3 would make 3x4 > 10; 9 and 1 would make 2x9 > 10
    assert bins == [[0, 1], [2], [3], [4]]
    for b in bins:
        assert batch_area([lengths[i] for i in b], "padded", 10) <= 10


def test_rejects_documents_over_budget():
    with pytest.raises(ValueError, match="data.overlong"):
        pack_bfd([5, 11], 10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=120), st.sampled_from(["bfd", "greedy", "padded"]))
def test_every_scheme_places_each_document_once_within_budget(lengths, scheme):
    budget = 64
    bins = {"bfd": pack_bfd, "greedy": pack_greedy, "padded": pack_padded}[scheme](lengths, budget)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    for b in bins:
        assert b
        assert batch_area([lengths[i] for i in b], scheme, budget) <= budget
        assert sum(lengths[i] for i in b) <= budget
    assert len(bins) >= lower_bound(np.array(lengths), budget)
    if scheme == "bfd":  # BFD never does worse than next-fit
        assert len(bins) <= len(pack_greedy(lengths, budget))


def _corpus(lengths, seed=0) -> Corpus:
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(3, 500, size=int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(len(tokens)) < 0.5, tokens, IGNORE).astype(np.int32)
    return Corpus.from_arrays(tokens, labels, offsets, np.arange(len(lengths)), BadRows(), len(lengths))


def test_packed_micro_batch_field_by_field():
    from entrypoint.data.micro_batches import build_micro_batch

    corpus = _corpus([5, 3, 7, 2])
    bins = pack_bfd(corpus.lengths, 16)
    assert sorted(len(b) for b in bins) == [1, 3]
    for doc_ids in bins:
        mb = build_micro_batch(corpus, doc_ids, packed=True, budget=16, pad_token_id=0)
        ids = mb.inputs["input_ids"][0].tolist()
        labels = mb.labels[0].tolist()
        pos = mb.inputs["position_ids"][0].tolist()
        seq = mb.inputs["seq_idx"][0].tolist()
        cu = mb.inputs["cu_seq_lens_q"].tolist()
        lengths = [int(corpus.lengths[i]) for i in doc_ids]
        n = sum(lengths)
        assert len(ids) == len(labels) == len(pos) == len(seq) == 16
        assert mb.n_real == n and mb.area == 16 and mb.doc_lengths == lengths
        cursor = 0
        for k, (i, length) in enumerate(zip(doc_ids, lengths)):
            a = int(corpus.offsets[i])
            assert ids[cursor:cursor + length] == corpus.tokens[a:a + length].tolist()
            assert labels[cursor] == IGNORE  # never predict a doc's first token from the previous doc
            assert labels[cursor + 1:cursor + length] == corpus.labels[a + 1:a + length].tolist()
            assert pos[cursor:cursor + length] == list(range(length))
            assert seq[cursor:cursor + length] == [k] * length
            cursor += length
        assert cu == [0] + list(np.cumsum(lengths + ([16 - n] if n < 16 else [])))
        assert all(x == IGNORE for x in labels[n:]) and all(x == 0 for x in ids[n:])
        assert mb.inputs["cu_seq_lens_q"].dtype.is_floating_point is False
        assert str(mb.inputs["seq_idx"].dtype) == "torch.int32"
        assert mb.n_loss == sum(1 for x in labels[1:] if x != IGNORE)


def test_padded_micro_batch_field_by_field():
    from entrypoint.data.micro_batches import build_micro_batch

    corpus = _corpus([5, 3])
    mb = build_micro_batch(corpus, [1, 0], packed=False, budget=16, pad_token_id=0)
    assert mb.inputs["input_ids"].shape == (2, 5) and mb.area == 10 and mb.n_real == 8
    assert mb.inputs["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert mb.inputs["input_ids"][0].tolist() == corpus.tokens[5:8].tolist() + [0, 0]
    assert mb.labels[0].tolist() == [IGNORE] + corpus.labels[6:8].tolist() + [IGNORE, IGNORE]
    assert mb.labels[1].tolist() == [IGNORE] + corpus.labels[1:5].tolist()


def _sampler(lengths, **kw):
    args = dict(scheme="bfd", budget=64, window=16, seed=3)
    args.update(kw)
    return PackedSampler(np.asarray(lengths), **args)


def test_sampler_is_deterministic_and_ranks_partition_the_stream():
    lengths = np.random.default_rng(1).integers(1, 64, size=100)
    a = _sampler(lengths, world_size=2, rank=0, grad_accum=2)
    b = _sampler(lengths, world_size=2, rank=1, grad_accum=2)
    single = _sampler(lengths)
    stream = [single.next_step()[1][0] for _ in range(40)]
    got = []
    for _ in range(10):
        got += a.next_step()[1] + b.next_step()[1]
    assert got == stream
    assert _sampler(lengths).next_step() == _sampler(lengths).next_step()
    assert _sampler(lengths, seed=4).next_step() != _sampler(lengths).next_step()


def test_sampler_covers_each_document_once_per_epoch_and_continues():
    lengths = np.random.default_rng(2).integers(1, 64, size=50)
    s = _sampler(lengths)
    seen, epoch = [], 0
    while epoch == 0:
        epoch, bins = s.next_step()
        if epoch == 0:
            seen += bins[0]
    assert sorted(seen) == list(range(50))
    assert epoch == 1  # the stream runs on into the next epoch, reshuffled


def test_sampler_state_resumes_exactly_and_rejects_changes():
    lengths = np.random.default_rng(3).integers(1, 64, size=80)
    s = _sampler(lengths)
    for _ in range(7):
        s.next_step()
    state = s.state_dict()
    cont = [s.next_step() for _ in range(20)]
    r = _sampler(lengths)
    r.load_state_dict(state)
    assert [r.next_step() for _ in range(20)] == cont
    with pytest.raises(SamplerStateError, match="budget"):
        _sampler(lengths, budget=128).load_state_dict(state)


def test_pack_windows_only_mixes_within_a_window():
    lengths = np.full(40, 10)
    order = np.arange(40)
    bins = pack_windows(lengths, order, "bfd", 64, 8, np.random.default_rng(0))
    for b in bins:
        assert len({i // 8 for i in b}) == 1
