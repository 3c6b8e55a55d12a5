"""The HTTP servers (health, metrics, health-check node ports) under slow, silent and
numerous clients, with real sockets on 127.0.0.1: a probe is answered within 100 ms at the
99th percentile while hundreds of clients trickle their requests, every connection ends by
its deadline, and no client costs a thread (issue 28)."""

from __future__ import annotations

import resource
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from ipvsproxy import serve
from ipvsproxy.serve import HttpServer
from tests.support import eventually

ROUTES = {"/healthz": lambda: (200, "text/plain", b"ok\n")}
SLOW_CLIENTS = 200  # the namespace/bench check runs 1,000 (bench/http_abuse.py)


@contextmanager
def serving(*, request_timeout: float = 5.0, routes=ROUTES) -> Iterator[HttpServer]:
    server = HttpServer(("127.0.0.1", 0), routes, request_timeout=request_timeout).start()
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


def get(server: HttpServer, path: str = "/healthz") -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as r:
        body: bytes = r.read()
        return body


def exchange(port: int, request: bytes, *, timeout: float = 5.0) -> bytes:
    """Sends `request` on a new connection and reads the answer to the end."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def probe(port: int, path: str = "/healthz", *, timeout: float = 2.0) -> float:
    """Seconds for one GET on a new connection, `timeout` if it fails or takes longer."""
    started = time.monotonic()
    try:
        answer = exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), timeout=timeout)
    except OSError:
        return timeout
    ok = answer.split(b"\r\n", 1)[0].split(b" ")[1:2] == [b"200"]
    return time.monotonic() - started if ok else timeout


HOLD = 120.0  # seconds a slow client may hold its request open in the tests below
PROBE_DEADLINE = 30.0  # generous for a loaded machine, and far below HOLD


def answered(port: int, path: str = "/healthz", *, timeout: float = PROBE_DEADLINE) -> bool:
    """Whether one GET on a new connection is answered 200 within `timeout`."""
    return probe(port, path, timeout=timeout) < timeout


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


class Tricklers:
    """`count` clients sending a request head a byte at a time (`rate` bytes per second
    each), reconnecting when cut off, from one thread: the issue's slow-client attack."""

    def __init__(self, port: int, count: int, *, rate: float = 2.0) -> None:
        self.port, self.count, self.rate = port, count, rate
        self.stop = threading.Event()
        self.cut = 0
        self._socks: list[socket.socket | None] = [None] * count
        self._thread = threading.Thread(target=self._run, name="tricklers", daemon=True)

    def __enter__(self) -> Tricklers:
        for i in range(self.count):
            self._socks[i] = self._connect()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(10)
        for sock in self._socks:
            if sock is not None:
                sock.close()

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        except OSError:
            return None
        sock.setblocking(False)
        return sock

    def _run(self) -> None:
        while not self.stop.wait(1 / self.rate):
            for i, sock in enumerate(self._socks):
                try:
                    if sock is None:
                        raise OSError
                    sock.send(b"X")
                except OSError:
                    self.cut += 1
                    if sock is not None:
                        sock.close()
                    self._socks[i] = self._connect()


@pytest.fixture(autouse=True)
def _descriptors():
    """Enough descriptors for both ends of a few hundred connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, max(soft, 4096))
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---- under abuse -------------------------------------------------------------------------


def test_healthz_is_answered_while_200_slow_clients_hold_their_requests_open():
    """The slow-client attack: 10 such clients took a thread-per-connection /healthz (8
    threads) to 2.4-3.95 s. Here the slow clients may hold their requests for HOLD seconds:
    a server that served them before the probes (one at a time, or from a pool they fill)
    would answer no probe until they are cut. Every probe is answered while none of them has
    been cut yet. How fast is a benchmark: bench/http_abuse.py, docs/performance.md."""
    with serving(request_timeout=HOLD) as server, Tricklers(server.port, SLOW_CLIENTS) as slow:
        time.sleep(0.5)  # every slow client connected and trickling
        assert all(answered(server.port) for _ in range(100))  # stops at the first miss
        assert slow.cut == 0, "a slow client was cut: the probes were not answered beside them"


def test_threads_do_not_grow_with_clients():
    before = threading.active_count()
    with serving() as server, ExitStack() as stack:
        for _ in range(SLOW_CLIENTS):
            silent_client(server, stack)
        with serving() as other:  # a second port: the same loop, the same thread
            eventually(lambda: len(server.open) == SLOW_CLIENTS, 5.0)
            assert threading.active_count() == before + 1
            assert get(other) == b"ok\n"
    eventually(lambda: threading.active_count() == before, 5.0, "the loop's thread ends")


def test_beyond_the_connection_cap_the_oldest_connection_is_closed(monkeypatch):
    monkeypatch.setattr(serve, "max_connections", lambda: 10)
    with serving() as server, ExitStack() as stack:
        socks = [silent_client(server, stack) for _ in range(10)]
        eventually(lambda: len(server.open) == 10, 5.0)
        assert get(server) == b"ok\n"  # the 11th: answered, the oldest closed for it
        assert closed_after(socks[0]) < 2
        assert len(server.open) <= 10
        assert serve.REACTOR.connections.evicted >= 1


# ---- deadlines and limits ----------------------------------------------------------------


def test_a_silent_connection_is_closed_after_the_request_timeout():
    with serving(request_timeout=0.5) as server, ExitStack() as stack:
        sock = silent_client(server, stack)
        # closed by the server's deadline, not by the client's own timeout (10 s)
        assert 0.3 <= closed_after(sock) < 9
        eventually(lambda: not server.open, 5.0)


def test_a_trickling_client_is_cut_at_the_deadline_of_the_whole_request():
    """Each byte comes well within any per-read timeout, but the request never ends."""
    with serving(request_timeout=0.6) as server, ExitStack() as stack:
        sock = silent_client(server, stack)
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.0\r\n")
        cut = False
        while time.monotonic() - started < 30:
            try:
                sock.sendall(b"X-Slow: y\r\n")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.2)
            if _closed_by_peer(sock):
                cut = True
                break
        assert cut, "the server kept the request open for 30 s (its deadline: 0.6 s)"


def test_a_client_that_never_reads_a_large_answer_is_closed_at_the_deadline():
    big = {"/big": lambda: (200, "text/plain", b"x" * (8 << 20))}
    with serving(request_timeout=0.5, routes=big) as server, ExitStack() as stack:
        sock = silent_client(server, stack)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /big HTTP/1.1\r\n\r\n")
        eventually(lambda: len(server.open) == 1, 5.0)
        eventually(lambda: not server.open, 3.0, "closed at its deadline, answer unsent")
        with serving() as other:
            assert get(other) == b"ok\n"
        assert len(exchange(server.port, b"GET /big HTTP/1.1\r\n\r\n")) > 8 << 20


def test_a_request_head_over_the_limit_gets_431():
    with serving() as server:
        big = b"GET /healthz HTTP/1.1\r\n" + b"X-Big: " + b"y" * serve.MAX_HEAD + b"\r\n\r\n"
        answer = exchange(server.port, big)
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert exchange(server.port, b"GET /healthz HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\nok\n")


def test_closing_the_server_does_not_wait_for_a_silent_client():
    with ExitStack() as stack, serving(request_timeout=30) as server:
        silent_client(server, stack)
        eventually(lambda: len(server.open) == 1, 5.0)
        started = time.monotonic()
    assert time.monotonic() - started < 20  # closed at once, not after the client's 30 s


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="request_timeout"):
        HttpServer(("127.0.0.1", 0), ROUTES, request_timeout=0)


# ---- what is answered --------------------------------------------------------------------


def test_head_is_answered_like_get_without_a_body():
    with serving() as server:
        got = exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = exchange(server.port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert head.endswith(b"\r\n\r\n")  # no body
    assert b"Content-Length: 3\r\n" in head
    assert b"Content-Type: text/plain\r\n" in head
    assert got.endswith(b"\r\n\r\nok\n")


def test_no_server_header_gives_the_python_version():
    with serving() as server:
        answer = exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head = answer.partition(b"\r\n\r\n")[0].lower()
    assert b"\r\nserver:" not in head
    assert b"python" not in head


def test_other_methods_404_and_a_route_that_fails():
    def broken() -> tuple[int, str, bytes]:
        raise RuntimeError("a bug")

    with serving(routes={**ROUTES, "/broken": broken}) as server:
        assert exchange(server.port, b"POST /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 501 ")
        assert exchange(server.port, b"GET /nope HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 404 ")
        assert exchange(server.port, b"GET /broken HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500 ")
        assert exchange(server.port, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert exchange(server.port, b"GET /healthz?x=1 HTTP/1.1\n\n").endswith(b"\r\n\r\nok\n")


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


def test_a_slow_route_runs_in_the_worker_while_probes_are_answered():
    """A route that reads the kernel (`InThread`) does not hold the event loop: /healthz is
    answered at once while it runs, and its own answer arrives when it is done."""
    release = threading.Event()

    def slow():
        release.wait(10)
        return 200, "text/plain", b"slow\n"

    routes = {**ROUTES, "/slow": serve.InThread(slow)}
    with serving(routes=routes) as server:
        answers: list[bytes] = []
        waiting = threading.Thread(target=lambda: answers.append(get(server, "/slow")))
        waiting.start()
        time.sleep(0.2)  # the slow route is running in the worker
        assert probe(server.port) < 0.1
        assert not answers
        release.set()
        waiting.join(10)
        assert answers == [b"slow\n"]
        assert exchange(server.port, b"HEAD /slow HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\n")


def test_a_slow_route_is_skipped_for_a_client_gone_by_its_turn():
    """Requests queued behind a slow answer whose deadline passes are never computed: slow
    clients cannot pile up work in the worker."""
    calls: list[int] = []
    release = threading.Event()

    def slow():
        calls.append(1)
        release.wait(10)
        return 200, "text/plain", b"slow\n"

    routes = {**ROUTES, "/slow": serve.InThread(slow)}
    with serving(routes=routes, request_timeout=0.5) as server:
        first = threading.Thread(
            target=lambda: exchange(server.port, b"GET /slow HTTP/1.1\r\n\r\n")
        )
        first.start()
        eventually(lambda: calls == [1])
        queued = [exchange(server.port, b"GET /slow HTTP/1.1\r\n\r\n", timeout=5) for _ in range(3)]
        assert queued == [b"", b"", b""]  # each closed at its deadline, unanswered
        release.set()
        first.join(10)
        time.sleep(0.1)
        assert calls == [1]  # the three were skipped when the worker came to them
        release.clear()
        release.set()
        assert get(server, "/slow") == b"slow\n"
        assert len(calls) == 2


def test_a_slow_route_that_fails_gets_500():
    def broken():
        raise RuntimeError("bug")

    with serving(routes={"/slow": serve.InThread(broken)}) as server:
        assert exchange(server.port, b"GET /slow HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500")


# ---- /readyz and loopback-only routes ----------------------------------------------------


def test_readyz_is_503_until_a_full_pass_then_answers_as_healthz():
    health = serve.Health(timeout=10, clock=lambda: 100.0)
    code, _, body, _ = health.readyz()
    assert code == 503
    assert b'"waitingFor": "starting' in body
    assert health.healthz()[0] == 200  # kube-proxy's: healthy while starting up
    health.waiting("the first list of Services from the API")
    assert b"the first list of Services" in health.readyz()[2]
    health.updated()  # a partial pass (a pass after a failed full one) is not enough
    assert health.readyz()[0] == 503
    health.updated(full=True)
    code, _, body, _ = health.readyz()
    assert code == 200
    assert b'"ready": true' in body
    assert b"waitingFor" not in body
    health.node_eligible(False)  # then as /healthz: the node's eligibility counts
    assert health.readyz()[0] == health.healthz()[0] == 503


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [("127.0.0.1", True), ("127.3.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("192.0.2.2", False), ("::ffff:192.0.2.2", False), ("fe80::1%eth0", False), ("", False)],
)  # fmt: skip
def test_loopback_peers(peer, loopback):
    assert serve.is_loopback(peer) is loopback


def _own_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses (none on a machine with only lo)."""
    import subprocess

    shown = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    found = [line.split()[3].split("/")[0] for line in shown.splitlines() if " lo " not in line]
    return [a for a in found if not a.startswith("127.")]


def test_a_loopback_only_route_answers_403_to_a_client_on_another_address():
    """Served on every address (as the metrics port is), a LoopbackOnly route answers the
    node's loopback and refuses a client reaching it on the node's own network address (a
    pod or another host does); the other routes answer both."""
    others = _own_addresses()
    if not others:
        pytest.skip("this host has no non-loopback address to connect from")
    routes: dict[str, serve.Route | serve.LoopbackOnly] = {
        "/status": serve.LoopbackOnly(lambda: (200, "text/plain", b"secret\n")),
        "/metrics": lambda: (200, "text/plain", b"public\n"),
    }
    server = HttpServer(("0.0.0.0", 0), routes).start()
    try:

        def over(address: str, path: str) -> bytes:
            with socket.create_connection((address, server.port), timeout=5) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\n\r\n".encode())
                return sock.makefile("rb").read()

        assert over("127.0.0.1", "/status").startswith(b"HTTP/1.1 200")
        refused = over(others[0], "/status")
        assert refused.startswith(b"HTTP/1.1 403")
        assert b"secret" not in refused
        assert over(others[0], "/metrics").startswith(b"HTTP/1.1 200")
    finally:
        server.close()
