"""The HTTP servers (health, metrics) under slow and silent clients, with real sockets:
every request ends by its deadline, handler threads stay within the pool."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from ipvsproxy.serve import HttpServer
from tests.support import eventually

ROUTES = {"/healthz": lambda: (200, "text/plain", b"ok\n")}


@contextmanager
def serving(*, workers: int, request_timeout: float) -> Iterator[HttpServer]:
    server = HttpServer(
        ("127.0.0.1", 0), ROUTES, workers=workers, request_timeout=request_timeout
    ).start()
    try:
        yield server
    finally:
        server.close()


def silent_client(server: HttpServer, stack: ExitStack) -> socket.socket:
    """Connects and sends nothing."""
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=10))
    return sock


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes this connection (reads until EOF or reset)."""
    started = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def handler_threads(server: HttpServer) -> int:
    return sum(t.name == f"http-{server.port}-request" for t in threading.enumerate())


def get(server: HttpServer, path: str = "/healthz") -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as r:
        body: bytes = r.read()
        return body


def test_a_silent_connection_is_closed_after_the_request_timeout():
    with serving(workers=2, request_timeout=0.5) as server, ExitStack() as stack:
        sock = silent_client(server, stack)
        assert 0.3 <= closed_after(sock) < 3  # the client's own timeout (10 s) never fires
        eventually(lambda: handler_threads(server) == 0, 5.0)


def test_a_trickling_client_is_cut_at_the_deadline_of_the_whole_request():
    """Each byte comes well within the per-read timeout, but the request never ends."""
    with serving(workers=2, request_timeout=0.6) as server, ExitStack() as stack:
        sock = silent_client(server, stack)
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.0\r\n")
        cut = False
        while time.monotonic() - started < 5:
            try:
                sock.sendall(b"X-Slow: y\r\n")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.2)
            if _closed_by_peer(sock):
                cut = True
                break
        elapsed = time.monotonic() - started
        assert cut, "the server kept the request open for 5 s"
        assert elapsed < 3


def test_more_slow_clients_than_workers_never_start_more_handler_threads():
    workers, extra = 2, 3
    with serving(workers=workers, request_timeout=0.5) as server, ExitStack() as stack:
        for _ in range(workers + extra):
            silent_client(server, stack)
        seen = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            seen.append(handler_threads(server))
            time.sleep(0.01)
        assert max(seen) == workers  # busy, and never more
        assert get(server) == b"ok\n"  # slow clients still connected: a normal request answered


def test_a_normal_request_is_answered_at_once_while_slow_clients_hold_other_workers():
    with serving(workers=3, request_timeout=5) as server, ExitStack() as stack:
        for _ in range(2):
            silent_client(server, stack)
        eventually(lambda: handler_threads(server) == 2, 5.0)
        started = time.monotonic()
        assert get(server) == b"ok\n"
        assert time.monotonic() - started < 2  # not after the slow ones' 5 s timeout


def test_closing_the_server_does_not_wait_for_a_silent_client():
    with ExitStack() as stack, serving(workers=1, request_timeout=30) as server:
        silent_client(server, stack)
        eventually(lambda: handler_threads(server) == 1, 5.0)
        started = time.monotonic()
    assert time.monotonic() - started < 5  # the server closed before the client


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError, match="workers"):
        HttpServer(("127.0.0.1", 0), ROUTES, workers=0)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)
        sock.settimeout(10)
