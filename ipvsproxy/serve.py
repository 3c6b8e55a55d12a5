"""The agent's HTTP endpoints: health (`/healthz`, `/livez`) and Prometheus `/metrics`.

Owns: `Health` (kube-proxy's meaning: unhealthy when a queued sync has not completed within
2 x the sync period; /healthz also when this node is not eligible), `HttpServer` (a small
threaded server for a few fixed routes, or any path: at most `workers` requests at once,
each given `request_timeout` seconds in all, so a client that connects and sends nothing,
or trickles, cannot hold a thread or pile up new ones), and `parse_bind_address`.

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
from typing import Any

from ipvsproxy.errors import ConfigError

log = logging.getLogger(__name__)

Response = tuple[int, str, bytes]  # status, content type, body
Headed = tuple[int, str, bytes, Mapping[str, str]]  # ... and headers of its own
Route = Callable[[], Response | Headed]
JSON_HEADERS = {"X-Content-Type-Options": "nosniff"}  # as kube-proxy's health answers


class Health:
    """kube-proxy's proxy health (pkg/proxy/healthcheck/proxy_health.go): healthy unless a
    sync queued has not completed within `timeout`; `/healthz` also needs this node to be
    eligible (its Node object there, not being deleted, not tainted for deletion by the
    cluster autoscaler), `/livez` only the timing. `on_answer(path, code)` counts answers
    (kubeproxy_proxy_healthz_total / _livez_total)."""

    def __init__(
        self,
        *,
        timeout: float,
        clock: Callable[[], float] = time.time,
        on_answer: Callable[[str, int], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self._clock = clock
        self._on_answer = on_answer
        self._lock = threading.Lock()
        self._queued: float | None = None
        self._updated: float | None = None
        # eligible while starting, until the Node is known to say otherwise (kube-proxy)
        self._eligible = True
        self.detail: dict[str, object] = {}  # e.g. the backend in use and why

    def queued(self) -> None:
        with self._lock:
            if self._queued is None:
                self._queued = self._clock()

    def updated(self) -> None:
        with self._lock:
            self._updated = self._clock()
            self._queued = None

    def node_eligible(self, eligible: bool) -> None:
        with self._lock:
            self._eligible = eligible

    def healthy(self) -> bool:
        """The proxy's health alone, as kube-proxy's IsHealthy (the service health checks'
        serviceProxyHealthy): no queued sync overdue."""
        return self.status()[0]

    def status(self) -> tuple[bool, dict[str, object]]:
        now = self._clock()
        with self._lock:
            queued, updated = self._queued, self._updated
        healthy = queued is None or now - queued <= self.timeout
        body: dict[str, object] = {
            # kube-proxy reports the current time as lastUpdated while healthy
            "lastUpdated": _iso(now if healthy else updated),
            "currentTime": _iso(now),
            "healthy": healthy,
            **self.detail,
        }
        if queued is not None:
            body["oldestPendingQueued"] = _iso(queued)
        return healthy, body

    def healthz(self) -> Headed:
        healthy, body = self.status()
        with self._lock:
            eligible = self._eligible
        body = {**body, "nodeEligible": eligible, "healthy": healthy and eligible}
        return self._answer("/healthz", healthy and eligible, body)

    def livez(self) -> Headed:
        healthy, body = self.status()
        return self._answer("/livez", healthy, body)

    def _answer(self, path: str, healthy: bool, body: dict[str, object]) -> Headed:
        code = 200 if healthy else 503
        if self._on_answer is not None:
            self._on_answer(path, code)
        return code, "application/json", json.dumps(body).encode() + b"\n", JSON_HEADERS


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
    """Serves fixed routes from a daemon thread; `port` is the bound port (0 picks one).

    Bounded: at most `workers` handler threads; a connection that finds them all busy waits
    (for at most `request_timeout`) and is then closed unanswered. Each request has
    `request_timeout` seconds from its start to its end, whatever the client does.
    """

    def __init__(
        self,
        address: tuple[str, int],
        routes: Mapping[str, Route],
        *,
        workers: int = 8,
        request_timeout: float = 5.0,
    ) -> None:
        handler = _handler(dict(routes), request_timeout)
        family_v6 = ":" in address[0]
        server_class = _V6Server if family_v6 else _BoundedServer
        try:
            self._server = server_class(
                address, handler, workers=workers, request_timeout=request_timeout
            )
        except OSError as exc:
            raise ConfigError(f"cannot listen on {address[0]}:{address[1]}: {exc}") from exc
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _REAP_INTERVAL},
            name=f"http-{self.port}",
            daemon=True,
        )

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.closing.set()
        self._server.shutdown()
        self._server.server_close()


_REAP_INTERVAL = 0.1  # seconds between two looks for overdue requests


class _BoundedServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with a semaphore of `workers` slots and a deadline per request.

    The accept loop (one thread) takes a slot before starting a handler thread, so there are
    never more than `workers` of them; while it waits, further connections wait in the
    listen backlog. Between polls it closes (shuts down) every request past its deadline:
    the handler's blocked read or write then returns and its thread ends.
    """

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        workers: int,
        request_timeout: float,
    ) -> None:
        if workers < 1 or request_timeout <= 0:
            raise ValueError(f"need workers >= 1 ({workers}) and request_timeout > 0")
        self.request_timeout = request_timeout
        self.closing = threading.Event()
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accept loop: wait for a free slot, then handle in a thread of its own."""
        give_up = time.monotonic() + self.request_timeout
        while not self._slots.acquire(timeout=_REAP_INTERVAL):
            self.service_actions()  # requests past their deadline free their slots
            if self.closing.is_set() or time.monotonic() >= give_up:
                log.debug("http: %d requests busy, closing a connection from %s",
                          self._busy(), client_address)  # fmt: skip
                self.shutdown_request(request)
                return
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"http-{self.server_address[1]}-request",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:  # no thread could be started: refuse, keep serving
            self._slots.release()
            self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._deadlines[request] = time.monotonic() + self.request_timeout
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                del self._deadlines[request]
            self._slots.release()

    def service_actions(self) -> None:
        """Shut down the sockets of requests past their deadline (their threads then end)."""
        now = time.monotonic()
        with self._lock:
            overdue = [sock for sock, deadline in self._deadlines.items() if deadline <= now]
        for sock in overdue:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                continue

    def _busy(self) -> int:
        with self._lock:
            return len(self._deadlines)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone or cut off at its deadline: not worth a traceback on stderr."""
        log.debug("http: request from %s failed", client_address, exc_info=True)


class _V6Server(_BoundedServer):
    address_family = socket.AF_INET6


def _handler(routes: dict[str, Route], timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # each socket operation (the whole request: see _BoundedServer.service_actions)
        timeout = timeout_s

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            route = routes.get(self.path.split("?", 1)[0]) or routes.get("*")  # "*": any path
            reply = route() if route else (404, "text/plain", b"not found\n")
            status, ctype, body = reply[:3]
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            for name, value in (reply[3] if len(reply) > 3 else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler
