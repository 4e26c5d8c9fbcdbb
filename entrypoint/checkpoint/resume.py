"""What a checkpoint means, and what a resume may change.

A checkpoint records the config keys that shape the run from that point on: the learning-rate
schedule, the data stream and the step structure. Resuming with any of them changed would train
a different run than the one the config describes, silently (the schedule and the sampler come
back from the checkpoint). So a changed key is refused (exit 2) unless it is listed in
`checkpoint.allow_changed`, which applies it: the schedule is rebuilt from the current step, and
a changed data stream starts again from its beginning.

contracts.finetune_config.RESUME_KEYS is the table (also in the README).
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Any

from contracts.errors import FixableError
from contracts.finetune_config import RESUME_KEYS, FinetuneConfig

SCHEDULE_KEYS = ("train.lr", "train.max_steps", "train.warmup_steps", "train.min_lr_ratio", "train.epochs")
# keys whose change makes the saved data-stream position meaningless
STREAM_PATTERNS = ("data.*", "packing.*", "train.seed")
# keys that make a different tokenized corpus (so a different data.fingerprint): a change of one of
# them is named, never the fingerprint it changes
CORPUS_PATTERNS = ("data.*", "train.seed")


class ResumeRefused(FixableError):
    fix_in_str = True

    def __init__(self, message: str, fix: str):
        super().__init__(message, fix)


def run_config(cfg: FinetuneConfig, requested_packing: str | None = None) -> dict[str, Any]:
    """The resume-sensitive keys of `cfg`, dotted, as saved in every checkpoint. packing.mode is the
    one the config asked for (a fallback run trains padded whatever it asked, and says so)."""
    tree = cfg.to_dict()
    if requested_packing:
        tree["packing"]["mode"] = requested_packing
    out = {key: tree["train"][key.split(".")[1]] for key in RESUME_KEYS if key.startswith("train.")}
    for section in ("packing", "data"):
        out.update({f"{section}.{k}": v for k, v in tree[section].items()})
    return out


def covered(key: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def render(self) -> str:
        return f"{self.key}: {json.dumps(self.old)} -> {json.dumps(self.new)}"


def changes(saved: dict[str, Any], current: dict[str, Any], saved_fingerprint: Any = None,
            fingerprint: Any = None) -> list[Change]:
    found = [Change(k, saved.get(k), v) for k, v in current.items() if k in saved and saved[k] != v]
    if saved_fingerprint is not None and fingerprint is not None and saved_fingerprint != fingerprint and \
            not any(covered(c.key, CORPUS_PATTERNS) for c in found):
        found.append(Change("data.fingerprint", saved_fingerprint, fingerprint))
    return found


def corpus_keys(run: dict[str, Any]) -> dict[str, Any]:
    """The keys of a run_config that shape the tokenized corpus."""
    return {k: v for k, v in run.items() if covered(k, CORPUS_PATTERNS)}


def check(changed: list[Change], allowed: list[str], checkpoint: str) -> list[Change]:
    """The allowed changes, or ResumeRefused naming every refused one and the two ways out."""
    refused = [c for c in changed if not covered(c.key, allowed)]
    if refused:
        listed = "; ".join(c.render() for c in refused)
        keys = ", ".join(dict.fromkeys(c.key for c in refused))
        raise ResumeRefused(
            f"resuming {checkpoint} with changed keys that change what the checkpoint means: {listed}",
            f"start a new run in a fresh output.dir, or apply the change to this run with "
            f"checkpoint.allow_changed=[{keys}] (the schedule is rebuilt from the current step; a changed data "
            "stream starts from its beginning)")
    return changed


def stream_changed(applied: list[Change]) -> bool:
    return any(c.key == "data.fingerprint" or covered(c.key, STREAM_PATTERNS) for c in applied)


def schedule_changed(applied: list[Change]) -> bool:
    return any(c.key in SCHEDULE_KEYS for c in applied)
