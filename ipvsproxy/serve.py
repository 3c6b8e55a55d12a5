"""The agent's HTTP endpoints: health (`/healthz`, `/livez`, `/readyz`) and Prometheus `/metrics`.

Owns: `Health` (kube-proxy's meaning: unhealthy when a queued sync has not completed within
2 x the sync period; /healthz also when this node is not eligible; /readyz also until the
first full pass has completed: "this node is served"), `HttpServer` (a small event-driven
server for a few fixed routes, or any path, over TCP or TLS; a route may be `LoopbackOnly`, or
`Protected` by a check of the request's `Authorization` header), and `parse_bind_address`.

Every `HttpServer` of the process (the health and metrics ports, every health-check node
port) runs on one asyncio event loop in one daemon thread: a client costs a descriptor and a
few kilobytes, never a thread, so a thousand clients trickling their requests a byte at a
time (or ten thousand connecting at once) do not delay a probe. Each connection has one
deadline for its whole request, its head a size limit, and the process a cap on open
connections beyond which the oldest is closed (issue 28).

Imports: errors, following, the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import resource
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import formatdate
from http import HTTPStatus
from ipaddress import ip_address
from typing import Any

from ipvsproxy.errors import ConfigError
from ipvsproxy.following import Following

log = logging.getLogger(__name__)

Response = tuple[int, str, bytes]  # status, content type, body
Headed = tuple[int, str, bytes, Mapping[str, str]]  # ... and headers of its own
Route = Callable[[], Response | Headed]


@dataclass(frozen=True, slots=True)
class InThread:
    """A route whose answer takes time (it reads the kernel): computed in the one worker
    thread, `http-slow`, while the event loop goes on answering probes. One worker for every
    such route, so they run one at a time; a request whose connection has closed (its
    deadline passed while it queued) is skipped, so slow clients cannot pile up work."""

    route: Route | Callable[[str], Response | Headed]
    query: bool = False  # the route is called with the request's query string ("" if none)


@dataclass(frozen=True, slots=True)
class LoopbackOnly:
    """A route answered only to clients on this host's loopback (127.0.0.0/8, ::1, and
    IPv4-mapped loopback on a dual-stack socket); any other client gets 403. For what RBAC
    would not show an anonymous client (`/status`: every Service, endpoint, pod and node)
    on a port that also serves others (the metrics port, scraped from other hosts)."""

    route: Route | InThread


@dataclass(frozen=True, slots=True)
class Protected:
    """A route answered only when `check` (given the request's `Authorization` header, None
    without one) returns None; otherwise the refusal `check` returns. The check and the
    route run in the worker thread (as an `InThread` route), never the event loop: it may
    ask the API server (`delegation.Delegation.check`, the secure metrics port)."""

    route: Route | InThread
    check: Callable[[str | None], Headed | None]


FORBIDDEN: Headed = (
    403,
    "text/plain; charset=utf-8",
    b"forbidden: this path answers clients on the node's loopback only\n",
    {},
)


def is_loopback(peer: str) -> bool:
    """Whether a peer address (as `getpeername()` gives it) is this host's loopback."""
    try:
        address = ip_address(peer.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


JSON_HEADERS = {"X-Content-Type-Options": "nosniff"}  # as kube-proxy's health answers


class Health:
    """kube-proxy's proxy health (pkg/proxy/healthcheck/proxy_health.go): healthy unless a
    sync queued has not completed within `timeout`; `/healthz` also needs this node to be
    eligible (its Node object there, not being deleted, not tainted for deletion by the
    cluster autoscaler), `/livez` only the timing. `on_answer(path, code)` counts answers
    (kubeproxy_proxy_healthz_total / _livez_total).

    `/readyz` is ipvsproxy's own: 503 until a full pass has completed since start (after
    every kind was listed, and so after a table kube-proxy left was read and taken over),
    then /healthz's answer. kube-proxy's /healthz is 200 while it starts ("healthy while
    starting up"), right for a load balancer's health check and wrong for a readiness that
    a migration waits on before removing kube-proxy's rules. `waiting()` says why it is
    not ready yet (in the body, for `cleanup --kube-proxy` to name).

    `following` (the watchers' reads, `ipvsproxy.following`): while a resource cannot be
    read, every answer's body says so (`api`); past its bound, /readyz is 503 too ("this node
    is served" no longer holds: it does not follow changes), while /healthz and /livez keep
    kube-proxy's meaning (the rules in place still serve traffic, a load balancer keeps
    sending it; a restart would not mend a refused token). A full pass tells `following`
    that the node was served (the bound counts from the first) and every pass lets it check
    the bound."""

    def __init__(
        self,
        *,
        timeout: float,
        clock: Callable[[], float] = time.time,
        on_answer: Callable[[str, int], None] | None = None,
        following: Following | None = None,
    ) -> None:
        self.timeout = timeout
        self._following = following
        self._clock = clock
        self._on_answer = on_answer
        self._lock = threading.Lock()
        self._queued: float | None = None
        self._updated: float | None = None
        # eligible while starting, until the Node is known to say otherwise (kube-proxy)
        self._eligible = True
        self._served = False  # a full pass has completed since start (/readyz)
        self._waiting = "starting: no full pass has completed yet"
        self._detail: Mapping[str, object] = {}  # the backend in use and why, once chosen

    def queued(self) -> None:
        with self._lock:
            if self._queued is None:
                self._queued = self._clock()

    def updated(self, *, full: bool = False) -> None:
        """A pass completed; a `full` one makes this node served (/readyz)."""
        with self._lock:
            self._updated = self._clock()
            self._queued = None
            self._served = self._served or full
            served = self._served
        if self._following is not None:  # the first served pass starts the bound; checked
            (self._following.served if served else self._following.check)()

    def use_backend(self, detail: Mapping[str, object]) -> None:
        """The backend chosen (its name, why, what it lacks): shown in every answer's body."""
        with self._lock:
            self._detail = dict(detail)

    def waiting(self, reason: str) -> None:
        """What the agent waits for before its first full pass (shown by /readyz)."""
        with self._lock:
            self._waiting = reason

    @property
    def served(self) -> bool:
        with self._lock:
            return self._served

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
            queued, updated, detail = self._queued, self._updated, self._detail
        healthy = queued is None or now - queued <= self.timeout
        body: dict[str, object] = {
            # kube-proxy reports the current time as lastUpdated while healthy
            "lastUpdated": _iso(now if healthy else updated),
            "currentTime": _iso(now),
            "healthy": healthy,
            **detail,
        }
        if queued is not None:
            body["oldestPendingQueued"] = _iso(queued)
        unread = self._following.unread() if self._following is not None else None
        if unread is not None:
            body["api"] = {
                "following": not unread.stale,
                "resource": unread.kind,
                "unreadSeconds": round(unread.seconds, 1),
                "lastRead": _iso(unread.last_read),
                "error": unread.error,
            }
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

    def readyz(self) -> Headed:
        healthy, body = self.status()
        with self._lock:
            eligible, served, waiting = self._eligible, self._served, self._waiting
        api = body.get("api")
        following = not isinstance(api, dict) or bool(api["following"])
        ready = served and healthy and eligible and following
        body = {**body, "nodeEligible": eligible, "healthy": healthy and eligible}
        body["ready"] = ready
        if not served:
            body["waitingFor"] = waiting
        return self._answer("/readyz", ready, body)

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


MAX_HEAD = 8192  # bytes of request line and headers (kube-proxy's probes send ~100)
BACKLOG = 4096  # the listen queue (Linux caps it at net.core.somaxconn, 4096 by default)
ACCEPT_BATCH = 128  # connections accepted in one loop iteration
MAX_CONNECTIONS = 2048  # open at once in the process; half the descriptor limit if lower


def max_connections() -> int:
    """The process's cap on open HTTP connections: MAX_CONNECTIONS, or half the soft limit
    of open descriptors if that is lower (the rest stay for netlink, the API, iptables)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft // 2))


class HttpServer:
    """Serves fixed routes (or any path: route "*") on `address`; `port` is the bound port
    (0 picks one). The port is bound by the constructor (ConfigError if it cannot be), and
    served from `start()` until `close()` on the process's one event loop (`_Reactor`).

    One request per connection, answered with `Connection: close` (as kube-proxy's probes
    and cloud load balancers use the port); GET, and HEAD (the same answer without its
    body), 501 for other methods. Bounded, whatever clients do:
    - a connection has `request_timeout` seconds in all from its accept, for its request
      head and for our answer (one deadline, not per byte: a client trickling its request
      is cut at the deadline), and is then closed;
    - a request head (request line and headers) of more than `max_head` bytes gets 431;
    - at most `max_connections()` connections are open in the process: the next one
      accepted closes the oldest (`_Connections` says why).
    """

    def __init__(
        self,
        address: tuple[str, int],
        routes: Mapping[str, Route | InThread | LoopbackOnly | Protected],
        *,
        request_timeout: float = 5.0,
        max_head: int = MAX_HEAD,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if request_timeout <= 0 or max_head < 64:
            raise ValueError(
                f"need request_timeout > 0 ({request_timeout}) and max_head >= 64 ({max_head})"
            )
        self._routes = dict(routes)
        self.tls = tls  # HTTPS: each connection's handshake within its one deadline
        self.request_timeout = request_timeout
        self.max_head = max_head
        self._sock = _listen(address)
        self.port: int = self._sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self.open: set[_Connection] = set()  # touched in the loop's thread only

    def start(self) -> HttpServer:
        self._loop = REACTOR.acquire()
        try:
            _call(self._loop, self._start())
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stops listening and closes this server's open connections at once."""
        loop, self._loop = self._loop, None
        if loop is None:
            self._sock.close()
            return
        try:
            _call(loop, self._stop())
        finally:
            self._sock.close()
            REACTOR.release()

    async def _start(self) -> None:
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._accept)

    async def _stop(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        for conn in list(self.open):
            conn.close()

    def _accept(self) -> None:
        """Accepts up to ACCEPT_BATCH connections (in the loop's thread): a short batch keeps
        the loop answering between two, the long listen queue (BACKLOG) keeps a burst of
        connections from dropping a probe's SYN (a second lost)."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors or memory: try again shortly
                log.warning("http: cannot accept on port %d: %s", self.port, exc)
                self._pause()
                return
            _Connection(self, sock, address[0])

    def _pause(self) -> None:
        assert self._loop is not None
        fd = self._sock.fileno()
        self._loop.remove_reader(fd)
        self._loop.call_later(0.1, lambda: self._loop and self._loop.add_reader(fd, self._accept))

    def answer(
        self,
        method: str,
        target: str,
        peer: str = "127.0.0.1",
        headers: Mapping[str, str] | None = None,
    ) -> Headed | InThread:
        """The reply to one request from `peer` (the client's address; `headers` by lower-case
        name), computed in the event loop's thread, or the route that computes it in the
        worker thread (`InThread`)."""
        if method not in ("GET", "HEAD"):
            return 501, "text/plain", b"not implemented\n", {}
        route = self._routes.get(target.split("?", 1)[0]) or self._routes.get("*")
        if route is None:
            return 404, "text/plain", b"not found\n", {}
        if isinstance(route, LoopbackOnly):
            if not is_loopback(peer):
                return FORBIDDEN
            route = route.route
        if isinstance(route, Protected):
            inner = route.route
            answer = _bound(inner, target) if isinstance(inner, InThread) else inner
            authorization = (headers or {}).get("authorization")
            return InThread(functools.partial(_checked, route.check, authorization, answer))
        if isinstance(route, InThread):
            return route
        return call(route, target)


def _checked(
    check: Callable[[str | None], Headed | None], authorization: str | None, route: Route
) -> Response | Headed:
    """In the worker thread: the refusal of `check`, else the answer of `route`."""
    refusal = check(authorization)
    return route() if refusal is None else refusal


def _bound(answer: InThread, target: str) -> Route:
    """The route of `answer`, given the query string of `target` if it takes one."""
    if answer.query:
        return functools.partial(answer.route, target.partition("?")[2])  # type: ignore[call-arg]
    return answer.route  # type: ignore[return-value]


def call(route: Route, target: str) -> Headed:
    """A route's reply; a 500 when it raises (a bug in a route: the server goes on)."""
    try:
        reply = route()
    except Exception:
        log.exception("http: answering %r failed", target)
        return 500, "text/plain", b"internal error\n", {}
    return reply[0], reply[1], reply[2], reply[3] if len(reply) > 3 else {}


def _listen(address: tuple[str, int]) -> socket.socket:
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # "::" serves IPv4 too, whatever the host's default
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


def _call(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, None]) -> None:
    """Runs `work` on the event loop and waits for it (from any other thread)."""
    asyncio.run_coroutine_threadsafe(work, loop).result(timeout=30)


class _Connections:
    """The open connections of every server, oldest first, capped.

    At the cap, the next connection accepted closes the oldest one rather than being refused:
    a probe sends its request as it connects and is answered within a millisecond, so the
    oldest connection is almost always one holding the server without finishing its request.
    Refusing instead would let as many slow clients as the cap lock every probe out for as
    long as they keep reconnecting; closing the oldest makes an attacker open connections
    faster than a probe is answered to crowd one out. Descriptors stay bounded either way.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.evicted = 0
        self._open: dict[_Connection, None] = {}  # insertion order: oldest first

    def add(self, conn: _Connection) -> None:
        while len(self._open) >= self.cap:
            oldest = next(iter(self._open))
            del self._open[oldest]
            self.evicted += 1
            oldest.close()
        self._open[conn] = None

    def remove(self, conn: _Connection) -> None:
        self._open.pop(conn, None)

    def __len__(self) -> int:
        return len(self._open)


class _Connection:
    """One client, on its non-blocking socket: its request head is read until the blank
    line, then answered and the connection closed (no transport, no task: a few callbacks
    on the loop, so a burst of connections costs little)."""

    def __init__(self, server: HttpServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        sock.setblocking(False)
        # TLS: the handshake is driven by `readable` (and `writable` while it must write)
        self.handshaking = server.tls is not None
        if server.tls is not None:
            sock = server.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer  # the client's address
        self.head = bytearray()
        self.out = memoryview(b"")
        self.closed = False
        loop = self.loop = asyncio.get_running_loop()
        self.deadline = loop.call_later(server.request_timeout, self.close)
        server.open.add(self)
        REACTOR.connections.add(self)
        loop.add_reader(self.fd, self.readable)

    def readable(self) -> None:
        if self.handshaking and not self.handshake():
            return
        try:
            data = self.sock.recv(4096)
            while isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                data += self.sock.recv(4096)  # decrypted already: no readiness will say so
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        searched = max(0, len(self.head) - 3)  # the blank line may straddle two reads
        self.head += data
        end = _head_end(self.head, searched)
        if end > self.server.max_head or (end < 0 and len(self.head) > self.server.max_head):
            self.reply("GET", (431, "text/plain", b"request header fields too large\n", {}))
        elif end >= 0:
            self.request(bytes(self.head[:end]))

    def handshake(self) -> bool:
        """One step of the TLS handshake; True once it is done. A client that is not
        speaking TLS (or fails it) is closed."""
        assert isinstance(self.sock, ssl.SSLSocket)
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            self.loop.remove_writer(self.fd)
            self.loop.add_reader(self.fd, self.readable)
            return False
        except ssl.SSLWantWriteError:
            self.loop.remove_reader(self.fd)
            self.loop.add_writer(self.fd, self.readable)
            return False
        except (OSError, ValueError):
            self.close()
            return False
        self.handshaking = False
        self.loop.remove_writer(self.fd)
        self.loop.add_reader(self.fd, self.readable)
        return True

    def request(self, head: bytes) -> None:
        lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.reply("GET", (400, "text/plain", b"bad request\n", {}))
            return
        method, target, _ = parts
        headers = {}
        for field in lines[1:]:
            name, sep, value = field.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        answer = self.server.answer(method, target, self.peer, headers)
        if not isinstance(answer, InThread):
            self.reply(method, answer)
            return
        self.loop.remove_reader(self.fd)  # the request is read; the deadline still runs
        done = REACTOR.worker.submit(self._slow, _bound(answer, target), target)
        done.add_done_callback(lambda f: self._done(method, f))

    def _done(self, method: str, done: Future[Headed | None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has stopped: every server closed
            self.loop.call_soon_threadsafe(self._answered, method, done)

    def _slow(self, route: Route, target: str) -> Headed | None:
        """In the worker thread: the route's reply, or None when nobody waits for it."""
        return None if self.closed else call(route, target)

    def _answered(self, method: str, done: Future[Headed | None]) -> None:
        reply = done.result()
        if reply is not None and not self.closed:
            self.reply(method, reply)

    def reply(self, method: str, reply: Headed) -> None:
        """Sends the answer (the rest when the socket can take it) and then closes; what the
        client sends meanwhile is not read."""
        status, ctype, body, headers = reply
        self.loop.remove_reader(self.fd)
        self.head = bytearray()
        lines = [
            f"HTTP/1.1 {status} {_reason(status)}",
            f"Date: {formatdate(usegmt=True)}",
            f"Content-Type: {ctype}",
            *(f"{name}: {value}" for name, value in headers.items()),
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.out = memoryview(data if method == "HEAD" else data + body)
        if self.writable():
            self.loop.add_writer(self.fd, self.writable)

    def writable(self) -> bool:
        """Sends what it can; True while some is left (the deadline still runs)."""
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0
        except OSError:
            self.close()
            return False
        self.out = self.out[sent:]
        if self.out:
            return True
        self.close()
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.deadline.cancel()
        self.server.open.discard(self)
        REACTOR.connections.remove(self)
        self.sock.close()


def _head_end(data: bytearray, start: int) -> int:
    """Where the request head ends (its blank line; bare line feeds accepted as
    BaseHTTPRequestHandler did), or -1."""
    ends = [i for i in (data.find(b"\r\n\r\n", start), data.find(b"\n\n", start)) if i >= 0]
    return min(ends, default=-1)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class _Reactor:
    """The process's one event loop for HTTP, run by a daemon thread named `http` from the
    first server started until the last one closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.connections = _Connections(MAX_CONNECTIONS)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-slow")

    def acquire(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self.connections = _Connections(max_connections())
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=_run, args=(self._loop,), name="http", daemon=True
                )
                self._thread.start()
            self._users += 1
            return self._loop

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._loop is None:
                return
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


def _run(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


REACTOR = _Reactor()
