"""Per-rank RNG state as JSON: torch (and CUDA) generator bytes in base64, numpy's MT19937
state and Python's as plain lists. Data only: nothing in a checkpoint is unpickled."""
from __future__ import annotations

import base64
import random

import numpy as np
import torch

FORMAT = 1


class RngStateError(ValueError):
    """The saved state is not the shape this module writes."""


def capture() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"format": FORMAT,
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)},
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _bytes_tensor(text: object) -> torch.Tensor:
    if not isinstance(text, str):
        raise RngStateError("generator state is not base64 text")
    raw = base64.b64decode(text.encode(), validate=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def restore(state: object) -> None:
    """Apply a state written by capture(); RngStateError (or ValueError) if it is malformed."""
    try:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise RngStateError(f"unknown RNG state format {state.get('format') if isinstance(state, dict) else '?'}")
        torch_state = _bytes_tensor(state["torch"])
        n = state["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        if n["name"] != "MT19937" or keys.shape != (624,):
            raise RngStateError("numpy state is not an MT19937 state")
        numpy_state = ("MT19937", keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
        p = state["python"]
        internal = tuple(int(x) for x in p["internal"])
        gauss = p["gauss_next"]
        if gauss is not None:
            gauss = float(gauss)
        cuda_state = _bytes_tensor(state["cuda"]) if "cuda" in state and torch.cuda.is_available() else None
    except (KeyError, TypeError, ValueError) as exc:
        raise RngStateError(f"malformed RNG state: {exc}") from None
    torch.set_rng_state(torch_state)
    np.random.set_state(numpy_state)
    random.setstate((int(p["version"]), internal, gauss))
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
