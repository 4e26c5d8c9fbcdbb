"""The run plan: what the launcher decided (config, verify verdict, packing, topology) and every
worker reads. Typed, and written atomically as JSON beside the run's output."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from contracts import atomic
from contracts.finetune_config import FinetuneConfig, from_dict


@dataclass(frozen=True, kw_only=True)
class PackingDecision:
    requested: str             # what the config asked for: packed | padded
    effective: str             # what the run does
    reason: str


@dataclass(kw_only=True)
class RunPlan:
    config: FinetuneConfig
    config_file: str | None
    overrides: list[str]
    verify: dict[str, Any]             # verify's JSON report (the gate's verdict)
    allow_fallback: bool               # training although verify did not pass (the override was used)
    allow_fallback_flag: bool          # the override was given
    packing: PackingDecision
    lock: dict[str, Any] | None        # summary of the image's lock (None outside an image)
    topology: dict[str, Any]
    corpus: str = ""                   # the training corpus's manifest, built before the ranks started
    eval_corpus: str = ""              # the evaluation corpus's manifest ("" = no evaluation data)
    provenance: dict[str, str] = field(default_factory=dict)   # config key -> the layer that set it
    launched_at: float = 0.0           # time.time() when the launcher began (wall time, time to first step)
    action: str = "train"              # train | export (finetune export --checkpoint) | finish (the final
    #                                    checkpoint is saved: publish the export and the report it still owes)
    export_checkpoint: str = ""        # the step folder an export reads

    @property
    def packed(self) -> bool:
        return self.packing.effective == "packed"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "config": self.config.to_dict()}

    def write(self, path: Path) -> Path:
        atomic.write_text(path, json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> RunPlan:
        data = json.loads(Path(path).read_text())
        data["config"] = from_dict(data["config"])
        data["packing"] = PackingDecision(**data["packing"])
        return cls(**data)
