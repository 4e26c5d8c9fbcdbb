"""Can the trackers in output.report_to start? Asked by the launcher before any rank starts, each
within TIMEOUT_S seconds (the whole check, name lookup included: a call that ignores its timeout is
abandoned MARGIN_S later), so an unreachable server is one error naming the tracker, the cause and
the fix, never minutes of library retries after the ranks started.

  * wandb: only an online run is checked (WANDB_MODE=online, or WANDB_API_KEY set without
    WANDB_MODE): WANDB_BASE_URL (default https://api.wandb.ai) must answer, through the proxy the
    environment names, and accept the API key. Offline runs need nothing.
  * mlflow: a remote MLFLOW_TRACKING_URI (http, https, databricks, a database) must answer a
    read-only search through mlflow's own client, with its retries off; a local store (`file:`,
    `sqlite:`, unset: `<output.dir>/mlruns`) needs a writable folder.
  * tensorboard writes under output.dir (checked writable with it).
The fix always names the way to train without the server: the tracker's offline mode, a local
MLFLOW_TRACKING_URI=file:..., or removing it from output.report_to (metrics.jsonl is always written).
"""
from __future__ import annotations

import base64
import contextlib
import json
import netrc
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from contracts.errors import FixableError

TIMEOUT_S = 10
MARGIN_S = 2   # a probe's sockets time out within TIMEOUT_S; past this margin a call with no timeout of its
#                own (a DNS lookup without network) is abandoned
WANDB_DEFAULT_URL = "https://api.wandb.ai"
OFFLINE_WANDB_MODES = ("offline", "dryrun", "disabled")


class TrackerUnavailable(FixableError):
    def __init__(self, tracker: str, cause: str, fix: str):
        super().__init__(f"output.report_to: {tracker} cannot start: {cause}", fix)
        self.tracker, self.cause = tracker, cause


def _fix(tracker: str) -> str:
    offline = {"wandb": "set WANDB_MODE=offline (runs are kept under output.dir/wandb; `wandb sync` them later)",
               "mlflow": "set MLFLOW_TRACKING_URI=file:/path/to/mlruns (or unset it: output.dir/mlruns)"}[tracker]
    return (f"make the server reachable from this machine, or {offline}, or remove {tracker} from "
            "output.report_to (metrics.jsonl is always written)")


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def _endpoint(url: str, env: dict) -> tuple[str, int, str]:
    """(host, port, what) a request to `url` first connects to: the proxy the environment names, or
    the server itself."""
    parsed = urlparse(url)
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
    bypass = any(host == h or h == "*" or (h.startswith(".") and host.endswith(h)) or host.endswith("." + h)
                 for h in (x.strip() for x in no_proxy.split(",")) if h)
    proxy = "" if bypass else (env.get(f"{parsed.scheme}_proxy") or env.get(f"{parsed.scheme.upper()}_PROXY") or "")
    if proxy:
        p = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        return p.hostname or "", p.port or 80, f"the proxy {p.hostname}:{p.port or 80}"
    return host, port, f"{host}:{port}"


def reachable(url: str, env: dict, timeout: float) -> str | None:
    """None when a TCP connection to `url` (or its proxy) opens within `timeout` s, else why not."""
    host, port, what = _endpoint(url, env)
    if not host:
        return f"{url!r} names no host"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror:
        return f"{what}: the name does not resolve (no DNS or no network)"
    except TimeoutError:
        return f"{what}: no answer within {timeout:g} s"
    except ConnectionRefusedError:
        return f"{what}: connection refused"
    except OSError as exc:
        return f"{what}: {exc.strerror or _short(exc)}"


def _bounded(call, timeout: float, what: str) -> str | None:
    """Run `call(seconds_left)` (None or a cause) in a daemon thread: the whole check, name lookup
    included, ends within `timeout` + MARGIN_S s, and not answering by then is a cause of its own."""
    result: list = []
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    thread = threading.Thread(target=lambda: result.append(_guarded(lambda: call(left))), daemon=True)
    thread.start()
    thread.join(timeout + MARGIN_S)
    return result[0] if result else f"{what}: no answer within {timeout:g} s"


def _guarded(call) -> str | None:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - any failure of the probe is the cause we report
        return _short(exc)


def _wandb_key(env: dict, base_url: str) -> str:
    if env.get("WANDB_API_KEY"):
        return env["WANDB_API_KEY"]
    try:
        found = netrc.netrc(env.get("NETRC") or None).authenticators(urlparse(base_url).hostname or "")
    except (OSError, netrc.NetrcParseError):
        found = None
    return found[2] if found and found[2] else ""


def check_wandb(env: dict, timeout: float = TIMEOUT_S) -> None:
    mode = (env.get("WANDB_MODE") or "").strip().lower()
    if mode in OFFLINE_WANDB_MODES or (not mode and not env.get("WANDB_API_KEY")):
        return   # offline (the default without a key): nothing leaves the machine
    base = (env.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL).rstrip("/")
    key = _wandb_key(env, base)
    if not key:
        raise TrackerUnavailable("wandb", f"WANDB_MODE={mode or 'online'} but there is no API key (WANDB_API_KEY "
                                 "or a netrc entry)", "set WANDB_API_KEY, or " + _fix("wandb").split(", or ", 1)[1])
    cause = _bounded(lambda left: reachable(base, env, left()) or _wandb_viewer(base, key, left()), timeout, base)
    if cause:
        raise TrackerUnavailable("wandb", f"{base} ({cause}; checked within {timeout:g} s)", _fix("wandb"))


def _wandb_viewer(base: str, key: str, timeout: float) -> str | None:
    """The API key, asked of W&B's GraphQL endpoint (HTTP basic auth, user `api`)."""
    request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": "{ viewer { id } }"}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Basic " +
                                              base64.b64encode(f"api:{key}".encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:   # noqa: S310 - the user's W&B URL
            body = json.loads(response.read(1 << 20) or b"{}")
    except urllib.error.HTTPError as exc:
        return f"the API key was refused (HTTP {exc.code})" if exc.code in (401, 403) else f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return _short(getattr(exc, "reason", exc))
    except ValueError:
        return "the answer is not W&B's (not JSON): check WANDB_BASE_URL"
    viewer = (body.get("data") or {}).get("viewer") if isinstance(body, dict) else None
    return None if viewer else "the API key was not accepted (no user for it)"


def check_mlflow(env: dict, timeout: float = TIMEOUT_S) -> None:
    uri = (env.get("MLFLOW_TRACKING_URI") or "").strip()
    if not uri:
        return   # <output.dir>/mlruns: output.dir is checked writable
    scheme = urlparse(uri).scheme.lower()
    if scheme in ("", "file", "sqlite"):   # a local store: a folder (file:), or a database file's folder
        where = Path(uri.split(":///", 1)[-1]).parent if scheme == "sqlite" else Path(urlparse(uri).path or uri)
        existing = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
        if not (existing.is_dir() and os.access(existing, os.W_OK)):
            raise TrackerUnavailable("mlflow", f"MLFLOW_TRACKING_URI={uri}: {existing} is not a writable folder",
                                     "point MLFLOW_TRACKING_URI at a writable folder (file:/path/to/mlruns), or "
                                     "remove mlflow from output.report_to (metrics.jsonl is always written)")
        return
    # the client reads its settings (tokens, TLS) from os.environ: the run's, with retries off
    settings = {k: v for k, v in env.items() if k.startswith(("MLFLOW_", "DATABRICKS_"))}
    settings.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, int(timeout))))
    with process_env(settings):
        # mlflow is optional (not in every image): imported only when output.report_to asks for it
        from mlflow.tracking import MlflowClient  # imported first: its import is not the server's time

        def probe(left) -> str | None:
            if scheme in ("http", "https") and (cause := reachable(uri, env, left())):
                return cause
            return _mlflow_search(MlflowClient, uri)

        cause = _bounded(probe, timeout, uri)
    if cause:
        raise TrackerUnavailable("mlflow", f"MLFLOW_TRACKING_URI={uri} ({cause}; checked within {timeout:g} s)",
                                 _fix("mlflow"))


def _mlflow_search(client, uri: str) -> str | None:
    """One read-only request through mlflow's own client (its auth, TLS and store plugins)."""
    client(tracking_uri=uri).search_experiments(max_results=1)
    return None


def check(names: list[str], env: dict, timeout: float = TIMEOUT_S) -> None:
    """Raise TrackerUnavailable for the first tracker in `names` that cannot start."""
    for name in names:
        {"wandb": check_wandb, "mlflow": check_mlflow}.get(name, lambda _env, _t: None)(env, timeout)


@contextlib.contextmanager
def process_env(values: dict):
    """os.environ with `values` set for the block, then as it was (a client that reads its settings
    from the process's environment, not from arguments)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = ["MARGIN_S", "TIMEOUT_S", "TrackerUnavailable", "check", "process_env", "reachable"]
