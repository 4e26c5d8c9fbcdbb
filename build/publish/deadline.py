"""A wall-clock bound on each operation of the registry client: a watchdog cuts its connection
at the deadline.

A socket timeout bounds each wait for a byte, never a whole answer: a registry that trickles a
byte a second (its headers or its body) never trips it, and a 64 KiB manifest would take most
of a day. So every operation of `Registry` (a manifest read, a blob upload, with its token
request and retries) runs under one `Deadline`. The HTTP connections it uses register with the
deadline running in their thread (the connection classes mounted by `watch_session` do so when
they connect, send and wait for an answer), and a timer thread shuts those sockets down when
the deadline passes: the blocked read or write fails at once, and the client reports the
deadline instead of the broken connection. A connection cut this way is never reused (the pool
sees it dropped and opens a new one).
"""
from __future__ import annotations

import functools
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_active = threading.local()


class Deadline:
    def __init__(self, seconds: float):
        self.seconds = max(0.0, seconds)
        self.started = time.monotonic()
        self.expired = False
        self._stopped = False
        self._lock = threading.Lock()
        self._connections: list = []
        self._timer = threading.Timer(self.seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def attach(self, connection) -> None:
        with self._lock:
            if self._stopped:
                return
            if not any(c is connection for c in self._connections):
                self._connections.append(connection)
            if self.expired:
                _cut(connection)

    def _expire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.expired = True
            for connection in self._connections:
                _cut(connection)

    def stop(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._stopped = True
            self._connections.clear()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


def _cut(connection) -> None:
    """Shut the connection's socket down (both ways), which wakes a read or write blocked on it
    in another thread; closing it would not."""
    sock = getattr(connection, "sock", None)
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)   # the plain socket's, also under TLS
    except (OSError, TypeError, ValueError):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError, ValueError):
            pass


def running() -> Deadline | None:
    """The deadline of the operation running in this thread, if any."""
    return getattr(_active, "deadline", None)


@contextmanager
def deadline(seconds: float) -> Iterator[Deadline]:
    """Run the block under a deadline of `seconds`; inside an operation already under one, the
    block shares it (an upload's HEAD and POST are part of the upload)."""
    outer = running()
    if outer is not None:
        yield outer
        return
    current = Deadline(seconds)
    _active.deadline = current
    try:
        yield current
    finally:
        current.stop()
        _active.deadline = None


def _attach(connection) -> None:
    current = running()
    if current is not None:
        current.attach(connection)


def network_errors() -> tuple[type[BaseException], ...]:
    """What a request or a streamed body raises when the connection fails, stalls or is cut:
    requests' errors, and urllib3's and http.client's own, which reach a reader of `answer.raw`
    unwrapped."""
    # requests and urllib3 come with the docker SDK, which `--plan` and a bare GPU host
    # (`kernels build-here`) run without; both load this module
    import requests
    import urllib3

    return (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, http.client.HTTPException,
            ConnectionError, TimeoutError, ssl.SSLError)


@functools.cache
def _adapter_class():
    # as in network_errors(): requests and urllib3 load only when a registry is spoken to
    from requests.adapters import HTTPAdapter
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
    from urllib3.poolmanager import ProxyManager

    def watched(base):
        class Watched(base):
            def connect(self):
                _attach(self)
                super().connect()
                _attach(self)      # now it has its socket

            def request(self, *args, **kwargs):
                _attach(self)
                return super().request(*args, **kwargs)

            def getresponse(self, *args, **kwargs):
                _attach(self)
                return super().getresponse(*args, **kwargs)

        Watched.__name__ = f"Watched{base.__name__}"
        return Watched

    pools = {"http": type("WatchedPool", (HTTPConnectionPool,), {"ConnectionCls": watched(HTTPConnection)}),
             "https": type("WatchedTLSPool", (HTTPSConnectionPool,), {"ConnectionCls": watched(HTTPSConnection)})}

    class WatchedAdapter(HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = pools

        def proxy_manager_for(self, proxy, **kwargs):
            manager = super().proxy_manager_for(proxy, **kwargs)
            if type(manager) is ProxyManager:     # not a SOCKS manager, whose pools are its own
                manager.pool_classes_by_scheme = pools
            return manager

    return WatchedAdapter


def watch_session(session) -> None:
    """Mount connections that register with the running deadline on a requests session."""
    if hasattr(session, "mount"):
        adapter = _adapter_class()
        session.mount("http://", adapter())
        session.mount("https://", adapter())
