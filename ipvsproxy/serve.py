"""The agent's HTTP endpoints: health (`/healthz`, `/livez`) and Prometheus `/metrics`.

Owns: `Health` (kube-proxy's meaning: unhealthy when a queued sync has not completed within
2 x the sync period), `HttpServer` (a small threaded server for a few fixed routes), and
`parse_bind_address`.

Imports: errors, the standard library.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address

from ipvsproxy.errors import ConfigError

log = logging.getLogger(__name__)

Response = tuple[int, str, bytes]  # status, content type, body
Route = Callable[[], Response]


class Health:
    """When syncs were queued and completed; healthy unless one queued is overdue."""

    def __init__(self, *, timeout: float, clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._queued: float | None = None
        self._updated: float | None = None
        self.detail: dict[str, object] = {}  # e.g. the backend in use and why

    def queued(self) -> None:
        with self._lock:
            if self._queued is None:
                self._queued = self._clock()

    def updated(self) -> None:
        with self._lock:
            self._updated = self._clock()
            self._queued = None

    def status(self) -> tuple[bool, dict[str, object]]:
        now = self._clock()
        with self._lock:
            queued, updated = self._queued, self._updated
        healthy = queued is None or now - queued <= self.timeout
        body: dict[str, object] = {
            "lastUpdated": _iso(updated),
            "currentTime": _iso(now),
            "healthy": healthy,
            **self.detail,
        }
        if queued is not None:
            body["oldestPendingQueued"] = _iso(queued)
        return healthy, body

    def route(self) -> Response:
        healthy, body = self.status()
        return (200 if healthy else 503), "application/json", json.dumps(body).encode() + b"\n"


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def parse_bind_address(text: str, *, option: str) -> tuple[str, int]:
    """`127.0.0.1:10249`, `[::1]:10249`, `0.0.0.0:0` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        ip_address(host)
        number = int(port)
        if not sep or not 0 <= number <= 65535:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not ADDRESS:PORT") from None
    return host, number


class HttpServer:
    """Serves fixed routes from a daemon thread; `port` is the bound port (0 picks one)."""

    def __init__(self, address: tuple[str, int], routes: Mapping[str, Route]) -> None:
        handler = _handler(dict(routes))
        family_v6 = ":" in address[0]
        server_class = _V6Server if family_v6 else ThreadingHTTPServer
        try:
            self._server = server_class(address, handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {address[0]}:{address[1]}: {exc}") from exc
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"http-{self.port}", daemon=True
        )

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler(routes: dict[str, Route]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            route = routes.get(self.path.split("?", 1)[0])
            status, ctype, body = route() if route else (404, "text/plain", b"not found\n")
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler
