"""Where metrics go: metrics.jsonl always, and the trackers in output.report_to (TensorBoard,
Weights & Biases, MLflow), as axolotl and TRL users expect.

Each tracker works offline by default, so a cluster without egress still gets its logs:
  * wandb: WANDB_MODE=offline unless WANDB_MODE or WANDB_API_KEY is set; runs under
    <output.dir>/wandb (sync them later with `wandb sync`);
  * mlflow: a local file store, <output.dir>/mlruns, unless MLFLOW_TRACKING_URI is set;
  * tensorboard: <output.dir>/tensorboard (`output.tensorboard: true` is an alias).
A tracker whose package is not in the image is a config error (checked before any rank starts).
Only rank 0 writes. metrics.jsonl is appended without following a symlink, and a resumed run
first drops the records after the step it resumed from, so steps stay unique.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
INSTALL = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb", "mlflow": "mlflow-skinny"}


def requested(output) -> list[str]:
    """output.report_to, with the tensorboard alias folded in, in a stable order."""
    names = list(output.report_to) + (["tensorboard"] if output.tensorboard else [])
    return [n for n in PACKAGES if n in names]


def missing(output) -> list[str]:
    return [n for n in requested(output) if importlib.util.find_spec(PACKAGES[n]) is None]


def scalars(record: dict) -> dict[str, float]:
    return {f"train/{k}": float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard:
    def __init__(self, out: Path, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, run_name: str, config: dict):
        if not os.environ.get("WANDB_MODE") and not os.environ.get("WANDB_API_KEY"):
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        (out / "wandb").mkdir(exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ftimage"), name=run_name, dir=str(out),
                              config=config, resume="allow", id=os.environ.get("WANDB_RUN_ID"))

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, out: Path, run_name: str, config: dict):
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ["MLFLOW_TRACKING_URI"] = (out / "mlruns").absolute().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")   # the local store works offline
        import mlflow

        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "ftimage"))
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


SINKS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}


def flat_config(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def drop_records_after(path: Path, step: int) -> int:
    """Keep metrics.jsonl's records up to `step` (a resumed run logs the later ones again).
    Returns how many were dropped. Rewritten atomically; a symlink is never followed."""
    from contracts import atomic
    from contracts.folder_guard import is_real_file, read_bytes_nofollow

    if not is_real_file(path):
        return 0
    kept, dropped = [], 0
    for line in read_bytes_nofollow(path).decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        atomic.write_text(path, "".join(line + "\n" for line in kept))
    return dropped


class Metrics:
    """metrics.jsonl (one JSON object per line, fsynced each write so a killed run keeps its log)
    and the requested trackers, all with the same scalars."""

    def __init__(self, out_dir: Path, *, enabled: bool, trackers: list[str] = (), run_name: str = "",
                 config: dict | None = None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.sinks = []
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flat = flat_config(config or {})
            self.sinks = [SINKS[name](Path(out_dir), run_name, flat) for name in trackers]

    def write(self, record: dict, kind: str = "train") -> None:
        if not self.enabled:
            return
        from contracts.folder_guard import open_append_nofollow

        with open_append_nofollow(self.path) as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        values = {f"{kind}/{k.removeprefix('train/').removeprefix(kind + '_')}": v
                  for k, v in scalars(record).items()}
        for sink in self.sinks:
            sink.log(values, record["step"])

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
