"""Group documents into micro-batches under a token budget. Lengths in, index lists out.

Three schemes, all used by the entrypoint and by bench/packing_efficiency.py (same code, so the
benchmark measures what training does):

* `bfd`: 1D best-fit-decreasing. Within a window, longest document first; each goes into
  the open bin with the least room that still fits it, else a new bin.
* `greedy`: 1D next-fit in arrival order (what naive concatenation-without-splitting does).
* `padded`: the 2D baseline. Documents in arrival (random) order form a [n, max_len]
  batch while n * max_len stays within the budget; the rest of that rectangle is padding.

Work is per document, never per token: O(n log n) per window with bisect on a sorted
list of free-space keys.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

SCHEMES = ("bfd", "greedy", "padded")


def pack_bfd(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Best-fit-decreasing. Returns bins of indices into `lengths`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, budget)
    # stable sort, longest first, so equal lengths keep arrival order (determinism)
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    # Sorted keys free * stride + bin_id: bisect finds the tightest bin that fits, and
    # the bin id breaks ties deterministically.
    stride = 1 << 32
    keys: list[int] = []
    for idx, n in zip(order.tolist(), lengths[order].tolist()):
        pos = bisect.bisect_left(keys, n * stride)
        if pos < len(keys):
            key = keys.pop(pos)
            free, b = divmod(key, stride)
            free -= n
        else:
            b = len(bins)
            bins.append([])
            free = budget - n
        bins[b].append(idx)
        if free > 0:
            bisect.insort(keys, free * stride + b)
    return bins


def pack_greedy(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Next-fit in the given order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, budget)
    bins: list[list[int]] = []
    used = budget + 1
    for idx, n in enumerate(lengths.tolist()):
        if used + n > budget:
            bins.append([])
            used = 0
        bins[-1].append(idx)
        used += n
    return bins


def pack_padded(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """2D padded batches in the given order: grow while n * max_len <= budget."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, budget)
    bins: list[list[int]] = []
    longest = 0
    for idx, n in enumerate(lengths.tolist()):
        if bins and (len(bins[-1]) + 1) * max(longest, n) <= budget:
            bins[-1].append(idx)
            longest = max(longest, n)
        else:
            bins.append([idx])
            longest = n
    return bins


PACKERS = {"bfd": pack_bfd, "greedy": pack_greedy, "padded": pack_padded}


def batch_area(bin_lengths: Sequence[int], scheme: str, budget: int) -> int:
    """Token slots the micro-batch computes over: the full row when 1D packed (padded to
    the budget by collate_packed), the rectangle when 2D padded."""
    if scheme == "padded":
        return len(bin_lengths) * max(bin_lengths)
    return budget


def _check(lengths: np.ndarray, budget: int) -> None:
    if len(lengths) and (lengths.max() > budget or lengths.min() < 1):
        raise ValueError(
            f"document lengths must be in [1, {budget}], got [{lengths.min()}, {lengths.max()}]; "
            "truncate or skip over-long rows before packing (data.overlong)"
        )


class Bins:
    """An epoch's bins as two flat arrays (document ids, and where each bin starts), so a rank
    holds about 12 bytes per document for the epoch's plan instead of a Python list per bin and
    an int object per id (which made a rank's private memory grow with the corpus)."""

    def __init__(self, ids: np.ndarray, starts: np.ndarray):
        self.ids, self.starts = ids, starts     # starts has one more entry than there are bins

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> list[int]:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        return self.ids[self.starts[index]:self.starts[index + 1]].tolist()

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (Bins, list, tuple)) else NotImplemented


def pack_windows(lengths: np.ndarray, order: np.ndarray, scheme: str, budget: int, window: int,
                 rng: np.random.Generator | None = None) -> Bins:
    """Pack documents `order` (already shuffled) window by window; returns bins of document ids.

    BFD emits bins roughly longest-first; with an rng the bins of each window are shuffled
    so training does not see a length-sorted curriculum inside every window.
    """
    packer = PACKERS[scheme]
    id_dtype = np.int32 if len(lengths) < 2 ** 31 else np.int64
    ids_parts: list[np.ndarray] = []
    size_parts: list[np.ndarray] = []
    for start in range(0, len(order), window):
        ids = np.asarray(order[start:start + window])
        bins = packer(lengths[ids], budget)
        if rng is not None and scheme == "bfd":
            perm = rng.permutation(len(bins))
            bins = [bins[i] for i in perm]
        size_parts.append(np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins)))
        local = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(size_parts[-1].sum()))
        ids_parts.append(ids[local].astype(id_dtype))
    sizes = np.concatenate(size_parts) if size_parts else np.zeros(0, dtype=np.int64)
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    flat = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=id_dtype)
    return Bins(flat, starts)


def lower_bound(lengths: np.ndarray, budget: int) -> int:
    """No 1D packing can use fewer rows than ceil(total / budget)."""
    return int(-(-int(np.sum(lengths)) // budget))
