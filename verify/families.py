"""Model family -> what it needs fused. The facts live in model_families.json, not in code."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).with_name("model_families.json")


class UnknownFamily(Exception):
    def __init__(self, name: str, known: list[str]):
        super().__init__(f"model family {name!r} is not in {DATA_FILE.name} (known: {', '.join(known)})")
        self.fix = f"add {name!r} to verify/{DATA_FILE.name}, or build the image for one of: {', '.join(known)}"


@dataclass(frozen=True)
class FusedFunction:
    """One transformers function the family needs backed by a fused kernel package."""

    replaces: str          # the lock's `replaces` vocabulary, e.g. "causal_conv1d_fn"
    wrapper: str           # attribute of the modeling module that transformers wrapped
    package: str           # import name transformers tries, e.g. "fla"
    distribution: str
    symbol: str            # dotted path of the fused function
    boundary_kwarg: str    # the kwarg that carries document boundaries to the kernel
    forward_kernels: tuple[str, ...]
    backward_kernels: tuple[str, ...]


@dataclass(frozen=True)
class Attention:
    replaces: str
    implementation: str
    package: str
    distribution: str
    forward_kernels: tuple[str, ...]
    backward_kernels: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    name: str
    modeling_module: str
    config_class: str
    causal_lm_class: str
    gdn_class: str
    tiny_config: dict[str, Any]
    required_fused: tuple[FusedFunction, ...]
    attention: Attention


@lru_cache(maxsize=None)
def _data() -> dict[str, Any]:
    return json.loads(DATA_FILE.read_text())


def default_family() -> str:
    return _data()["default_family"]


def load_family(name: str) -> Family:
    families = _data()["families"]
    if name not in families:
        raise UnknownFamily(name, sorted(families))
    raw = families[name]
    fused = tuple(
        FusedFunction(
            replaces=f["replaces"], wrapper=f["wrapper"], package=f["package"],
            distribution=f["distribution"], symbol=f["symbol"], boundary_kwarg=f["boundary_kwarg"],
            forward_kernels=tuple(f["kernels"]["forward"]), backward_kernels=tuple(f["kernels"]["backward"]),
        )
        for f in raw["required_fused"]
    )
    a = raw["attention"]
    attention = Attention(
        replaces=a["replaces"], implementation=a["implementation"], package=a["package"],
        distribution=a["distribution"], forward_kernels=tuple(a["kernels"]["forward"]),
        backward_kernels=tuple(a["kernels"]["backward"]),
    )
    tiny = {k: v for k, v in raw["tiny_config"].items() if not k.startswith("_")}
    return Family(
        name=name, modeling_module=raw["modeling_module"], config_class=raw["config_class"],
        causal_lm_class=raw["causal_lm_class"], gdn_class=raw["gdn_class"], tiny_config=tiny,
        required_fused=fused, attention=attention,
    )
