"""Deterministic, checkpointable stream of micro-batches (lists of document ids).

The stream is a pure function of (seed, document lengths, scheme, budget, window): every
rank computes the same stream and takes its own slice, so no rank ever has to ship
indices to another. Epoch e shuffles documents with seed (seed, e), packs window by
window, and appends its bins to the stream. State is a single integer, the number of
micro-batches already consumed globally, so resuming is exact.

Step s, rank r, accumulation slot j takes stream item s*W*A + r*A + j (W ranks, A accum).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contracts.errors import FixableError
from entrypoint.data.packing import Bins, pack_windows


class SamplerStateError(FixableError):
    fix_in_str = True

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


@dataclass
class PackedSampler:
    lengths: np.ndarray
    scheme: str          # bfd | padded (see packing.py)
    budget: int
    window: int
    seed: int
    world_size: int = 1
    rank: int = 0
    grad_accum: int = 1
    position: int = 0    # micro-batches consumed globally (all ranks) so far

    def __post_init__(self):
        self._epoch_cache: dict[int, Bins] = {}
        self._epoch_starts = [0]   # stream index where each computed epoch starts

    def epoch_bins(self, epoch: int) -> Bins:
        if epoch not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(self.lengths))
            self._epoch_cache = {epoch: pack_windows(self.lengths, order, self.scheme, self.budget,
                                                     self.window, rng)}
        return self._epoch_cache[epoch]

    def item(self, index: int) -> tuple[int, list[int]]:
        """(epoch, document ids) of global stream item `index`."""
        epoch = 0
        while True:
            if epoch + 1 < len(self._epoch_starts):
                if index < self._epoch_starts[epoch + 1]:
                    return epoch, self.epoch_bins(epoch)[index - self._epoch_starts[epoch]]
                epoch += 1
                continue
            n = len(self.epoch_bins(epoch))
            self._epoch_starts.append(self._epoch_starts[epoch] + n)

    def next_step(self) -> tuple[int, list[list[int]]]:
        """This rank's micro-batches for the next step; advances the global position."""
        base = self.position + self.rank * self.grad_accum
        items = [self.item(base + j) for j in range(self.grad_accum)]
        self.position += self.world_size * self.grad_accum
        return items[-1][0], [ids for _, ids in items]

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "scheme": self.scheme, "budget": self.budget,
                "window": self.window, "world_size": self.world_size, "grad_accum": self.grad_accum,
                "n_docs": int(len(self.lengths)), "n_tokens": int(np.sum(self.lengths))}

    def load_state_dict(self, state: dict, allow_world_change: bool = True) -> None:
        """Continue the stream at the saved global position. The position counts micro-batches over
        all ranks, so a different world size or grad_accum continues it exactly (each step takes
        the next world * grad_accum items); a different stream (data, seed, packing) cannot."""
        mine = self.state_dict()
        keys = ("seed", "scheme", "budget", "window", "n_docs", "n_tokens")
        if not allow_world_change:
            keys += ("world_size", "grad_accum")
        changed = [k for k in keys if state.get(k) != mine[k]]
        if changed:
            detail = ", ".join(f"{k}: checkpoint {state.get(k)!r} vs now {mine[k]!r}" for k in changed)
            raise SamplerStateError(
                f"cannot resume the data stream exactly; it changed ({detail})",
                "resume with the same data, seed, packing and world size, or start a fresh output.dir",
            )
        self.position = int(state["position"])
