"""Trackers never hang or crash a run: one that cannot start is refused before any rank starts,
fast, in one error naming it, the cause and the fix (exit 2); one that fails mid-run is a warning,
and metrics.jsonl stays whole. Nothing here leaves the machine: every server is 127.0.0.1."""
from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from entrypoint.observability.tracker_check import TIMEOUT_S, TrackerUnavailable, check_mlflow, check_wandb
from tests.fixtures.chat import entrypoint_env, finetune_metrics, run_entrypoint, run_finetune
from tests.fixtures.trackers import MlflowStub

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def closed_port():
    """A 127.0.0.1 port bound and never listened on: every connection to it is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


def _local_only(**extra: str) -> dict:
    env = entrypoint_env(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(name, None)
    return env


def _refused_before_any_rank(fixture_dir, tmp_path, env: dict, tracker: str):
    out = tmp_path / "out"
    started = time.monotonic()
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), f"output.dir={out}",
                        f"output.report_to=[{tracker}]"], env=env, timeout=240)
    elapsed = time.monotonic() - started
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and tracker in errors[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"checked within {TIMEOUT_S} s" in errors[0]
    assert "running verify" not in r.stderr and not (out / ".launch").exists()   # no verify, no plan, no rank
    assert elapsed < 120, elapsed      # python, torch and the config; the check itself is bounded by TIMEOUT_S
    return errors[0], next(line for line in r.stderr.splitlines() if "fix:" in line)


@pytest.mark.unit
def test_an_unreachable_mlflow_server_is_refused_before_any_rank_starts(fixture_dir, tmp_path, closed_port):
    uri = f"http://127.0.0.1:{closed_port}"
    error, fix = _refused_before_any_rank(fixture_dir, tmp_path, _local_only(MLFLOW_TRACKING_URI=uri), "mlflow")
    assert uri in error and "connection refused" in error
    assert "MLFLOW_TRACKING_URI=file:" in fix and "remove mlflow from output.report_to" in fix


@pytest.mark.unit
def test_wandb_online_with_a_key_and_no_network_is_refused_before_any_rank_starts(fixture_dir, tmp_path,
                                                                                 closed_port):
    base = f"http://127.0.0.1:{closed_port}"
    env = _local_only(WANDB_MODE="online", WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=base, WANDB_SILENT="true")
    error, fix = _refused_before_any_rank(fixture_dir, tmp_path, env, "wandb")
    assert base in error and "connection refused" in error and FAKE_KEY not in error
    assert "WANDB_MODE=offline" in fix and "remove wandb from output.report_to" in fix


class _Server:
    """127.0.0.1 HTTP: `status` for every request, or never an answer (`hang`)."""

    def __init__(self, status: int = 200, body: dict | None = None, hang: bool = False):
        outer = self
        self.release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def do_POST(self):
                if hang:
                    outer.release.wait(30)
                    return
                data = json.dumps(body or {}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.unit
@pytest.mark.parametrize("server, said", [
    (dict(hang=True), "timed out"),
    (dict(status=401), "the API key was refused (HTTP 401)"),
    (dict(status=200, body={"data": {"viewer": None}}), "the API key was not accepted"),
])
def test_a_wandb_server_that_hangs_or_refuses_the_key_is_named_within_the_timeout(server, said):
    srv = _Server(**server)
    env = _local_only(WANDB_MODE="online", WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=srv.url)
    started = time.monotonic()
    try:
        with pytest.raises(TrackerUnavailable) as info:
            check_wandb(env, timeout=1)
    finally:
        srv.close()
    assert time.monotonic() - started < 5
    assert said in str(info.value) and info.value.tracker == "wandb" and "WANDB_MODE=offline" in info.value.fix


@pytest.mark.unit
@pytest.mark.parametrize("tracker, url_key", [("wandb", "WANDB_BASE_URL"), ("mlflow", "MLFLOW_TRACKING_URI")])
def test_a_name_lookup_that_never_answers_is_bounded_by_the_stated_timeout(monkeypatch, tracker, url_key):
    """Without network, getaddrinfo can block far past any socket timeout: the lookup is part of the
    bounded check, so the refusal comes within the timeout (+ the margin for an abandoned call)."""
    import socket as socket_module

    from entrypoint.observability.tracker_check import MARGIN_S, check

    if tracker == "mlflow":
        import mlflow.tracking  # noqa: F401 - the import is not the server's time (check_mlflow imports it first)
    release, asked = threading.Event(), []

    def lookup_that_hangs(host, *args, **kwargs):
        asked.append(host)
        release.wait(60)
        raise socket_module.gaierror("the lookup was abandoned")

    monkeypatch.setattr(socket_module, "getaddrinfo", lookup_that_hangs)
    url = "http://tracker.example.invalid:8080"
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": FAKE_KEY, url_key: url}
    started = time.monotonic()
    try:
        with pytest.raises(TrackerUnavailable) as info:
            check([tracker], env, timeout=1)
        elapsed = time.monotonic() - started
    finally:
        release.set()   # the abandoned lookup thread ends
    assert asked == ["tracker.example.invalid"]
    assert elapsed < 1 + MARGIN_S + 2, elapsed     # generous: the bound is 1 s + MARGIN_S
    message = str(info.value)
    assert "\n" not in message and info.value.tracker == tracker
    assert message == f"output.report_to: {tracker} cannot start: " + (
        f"{url} ({url}: no answer within 1 s; checked within 1 s)" if tracker == "wandb" else
        f"MLFLOW_TRACKING_URI={url} ({url}: no answer within 1 s; checked within 1 s)")
    assert f"remove {tracker} from output.report_to" in info.value.fix


@pytest.mark.unit
def test_trackers_that_need_no_server_are_not_asked(tmp_path):
    check_wandb({})                                   # no key: offline, the default
    check_wandb({"WANDB_API_KEY": FAKE_KEY, "WANDB_MODE": "offline"})
    check_mlflow({})                                  # output.dir/mlruns
    check_mlflow({"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri()})
    with MlflowStub() as stub:
        check_mlflow(_local_only(MLFLOW_TRACKING_URI=stub.uri))
    assert stub.calls[0][1].startswith("/api/2.0/mlflow/experiments/search")
    with pytest.raises(TrackerUnavailable) as info:
        check_wandb({"WANDB_MODE": "online", "NETRC": str(tmp_path / "none")})
    assert "no API key" in str(info.value)


@pytest.mark.unit
def test_a_tracker_that_raises_is_dropped_with_one_warning_and_metrics_jsonl_stays_whole(tmp_path, monkeypatch):
    from entrypoint.observability import trackers

    class Failing:
        def __init__(self, *_):
            self.calls = 0

        def log(self, values, step):
            raise ConnectionError("the server went away")

        def close(self):
            raise AssertionError("a dropped tracker is not closed")

    class Broken:
        def __init__(self, *_):
            raise OSError("cannot start")

    monkeypatch.setitem(trackers.SINKS, "wandb", Failing)
    monkeypatch.setitem(trackers.SINKS, "mlflow", Broken)
    said: list[str] = []
    metrics = trackers.Metrics(tmp_path, enabled=True, trackers=["wandb", "mlflow"], warn=said.append)
    for step in range(1, 6):
        metrics.write({"step": step, "loss": 1.0 / step})
    metrics.close()
    assert [m["step"] for m in finetune_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert len(said) == 2 and "mlflow could not start (OSError: cannot start)" in said[0]
    assert "wandb failed at step 1 (ConnectionError: the server went away)" in said[1]


@pytest.mark.training
def test_a_tracker_that_fails_mid_run_is_a_warning_and_the_run_completes(fixture_dir, tmp_path, monkeypatch):
    """MLflow answers the preflight check and the run's start, then refuses every metrics batch
    from the second on: one warning, the run goes to its end, metrics.jsonl holds every step."""
    out = tmp_path / "out"
    with MlflowStub(fail_from=2) as stub:
        for key, value in _local_only(MLFLOW_TRACKING_URI=stub.uri).items():
            monkeypatch.setenv(key, value)
        r = run_finetune(fixture_dir, out, "train.max_steps=4", "output.log_every=1", "checkpoint.every=0",
                         "output.report_to=[mlflow]", timeout=400)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    warnings = [line for line in text.splitlines() if "tracker mlflow failed at step 2" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "Traceback" not in text, text[-4000:]
    assert [m["step"] for m in finetune_metrics(out) if m.get("kind", "train") == "train"] == [1, 2, 3, 4]
    assert stub.metric_batches == 2                        # dropped after the failure: never asked again
    assert json.loads((out / "run_report.json").read_text())["final_step"] == 4
    assert Path(out / "metrics.jsonl").read_text().endswith("\n")
