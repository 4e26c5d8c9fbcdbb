"""Where metrics go: metrics.jsonl always, and the trackers in output.report_to (TensorBoard,
Weights & Biases, MLflow), as axolotl and TRL users expect.

Each tracker works offline by default, so a cluster without egress still gets its logs:
  * wandb: WANDB_MODE=offline unless WANDB_MODE or WANDB_API_KEY is set; runs under
    <output.dir>/wandb (sync them later with `wandb sync`);
  * mlflow: a local file store, <output.dir>/mlruns, unless MLFLOW_TRACKING_URI is set;
  * tensorboard: <output.dir>/tensorboard (`output.tensorboard: true` is an alias).
A tracker whose package is not in the image, or that cannot start (an unreachable server, a
refused key), is a config error, checked before any rank starts (tracker_check.py). One that
fails later, at its start in the rank or mid-run, is a WARNING: it gets no more metrics, and
metrics.jsonl, written first, keeps every one; the run goes on. MLflow's HTTP retries are bounded
in the rank (MLFLOW_HTTP_REQUEST_MAX_RETRIES=2, MLFLOW_HTTP_REQUEST_TIMEOUT=10 unless set) so a
server lost mid-run costs seconds, not minutes, and closing a tracker waits CLOSE_TIMEOUT_S at most.
Only rank 0 writes. metrics.jsonl is appended without following a symlink, and a resumed run
first drops the records after the step it resumed from, so steps stay unique.
"""
from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from pathlib import Path

from contracts import atomic
from contracts.folder_guard import is_real_file, open_append_nofollow, read_bytes_nofollow
from entrypoint.observability.console import Console

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
INSTALL = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb", "mlflow": "mlflow-skinny"}
CLOSE_TIMEOUT_S = 60


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
        # each tracker's package is optional (not in every image): imported when that tracker starts
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
        import wandb  # optional, as for tensorboard

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
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")     # mlflow's default retries for ~5 min
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Metric, Param  # optional, as for tensorboard
        from mlflow.tracking import MlflowClient

        # the client API, by run id: mlflow's "active run" is per thread, and close() runs in one
        self.client, self.metric = MlflowClient(), Metric
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ftimage")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in config.items()])

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


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


def _warn(message: str) -> None:
    Console(0).warn(message)


def _cause(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


class Metrics:
    """metrics.jsonl (one JSON object per line, fsynced each write so a killed run keeps its log)
    and the requested trackers, all with the same scalars. A tracker that raises is dropped with
    one warning (`warn`); metrics.jsonl and the run go on."""

    def __init__(self, out_dir: Path, *, enabled: bool, trackers: list[str] = (), run_name: str = "",
                 config: dict | None = None, warn=None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.warn = warn or _warn
        self.sinks: dict[str, object] = {}
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flat = flat_config(config or {})
            for name in trackers:
                try:
                    self.sinks[name] = SINKS[name](Path(out_dir), run_name, flat)
                except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                    self._lost(name, "could not start", exc)

    def _lost(self, name: str, when: str, exc: BaseException) -> None:
        self.warn(f"tracker {name} {when} ({_cause(exc)}); it gets no more metrics in this run, metrics.jsonl "
                  f"keeps every one (fix the tracker, or remove {name} from output.report_to)")

    def write(self, record: dict, kind: str = "train") -> None:
        if not self.enabled:
            return
        with open_append_nofollow(self.path) as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        values = {f"{kind}/{k.removeprefix('train/').removeprefix(kind + '_')}": v
                  for k, v in scalars(record).items()}
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(values, record["step"])
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                del self.sinks[name]
                self._lost(name, f"failed at step {record['step']}", exc)

    def close(self) -> None:
        """Close each tracker, each within CLOSE_TIMEOUT_S (a W&B upload to a lost server waits forever)."""
        for name, sink in self.sinks.items():
            failed: list[BaseException] = []
            thread = threading.Thread(target=_close, args=(sink, failed), daemon=True)
            thread.start()
            thread.join(CLOSE_TIMEOUT_S)
            if thread.is_alive():
                self.warn(f"tracker {name} did not close within {CLOSE_TIMEOUT_S} s; left behind (metrics.jsonl "
                          "is whole; a W&B run's local files are under output.dir/wandb: `wandb sync` them)")
            elif failed:
                self._lost(name, "failed to close", failed[0])
        self.sinks = {}


def _close(sink, failed: list) -> None:
    try:
        sink.close()
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        failed.append(exc)
