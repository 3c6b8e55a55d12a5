"""A broken or hostile API server (issue 28, items 5 and 8): every response is bounded in size
and time; `diff` says what went wrong in one line and exits 2; `run`'s watcher retries with
backoff and keeps running.

The server here is raw TLS on a socket (trustme's CA, the kubeconfig a client is given), so a
reply can be anything: an endless body, a line that never ends, one byte at a time, no HTTP at
all. Timeouts and caps are shortened through `kube.Settings` (and `kube.DIFF` for the CLI).
"""

from __future__ import annotations

import base64
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trustme
from click.testing import CliRunner

from ipvsproxy import kube
from ipvsproxy.backoff import Backoff
from ipvsproxy.cli import main
from ipvsproxy.errors import ApiUnavailable
from ipvsproxy.sync.tracker import SERVICE, SLICE, Tracker
from tests.kubeapi import ApiServer
from tests.support import connecting, eventually, never_resolving

ROOT = Path(__file__).parent.parent
STATE = ROOT / "examples" / "kernel-state.txt"
NODE = ["--hostname-override", "node-a", "--service-cidr", "10.96.0.0/16"]
KiB, MiB = 1024, 1024 * 1024
SHORT = kube.Settings(
    watch_timeout=1,
    inactivity_timeout=1,
    connect_timeout=1,
    read_timeout=1,
    list_deadline=1.5,
    max_page_bytes=1 * MiB,
    max_list_bytes=4 * MiB,
    max_event_bytes=256 * KiB,
    backoff=Backoff(first=0.05, cap=0.2),
)
# For the size caps: a list deadline no loaded machine reaches first, so that what cuts the
# list is the cap under test, whatever the machine's speed
CAPPED = replace(SHORT, list_deadline=120.0)
EMPTY = {
    "kind": "ServiceList",
    "apiVersion": "v1",
    "metadata": {"resourceVersion": "5"},
    "items": [],
}


class Raw:
    """A TLS server on 127.0.0.1: each request (its path, after the headers are read) is
    answered by `reply(server, connection, path)`; `sent` counts the bytes per request."""

    def __init__(self, reply: Callable[[Raw, ssl.SSLSocket, str], None], *, foreign: bool = False):
        self.ca = trustme.CA()
        signer = trustme.CA() if foreign else self.ca  # foreign: a CA the client does not trust
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        signer.issue_cert("127.0.0.1").configure_cert(self._context)
        self._reply = reply
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.closed = threading.Event()
        self.paths: list[str] = []
        self.sent: list[int] = []  # bytes written for each request so far
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self.connections += 1
        try:
            with self._context.wrap_socket(conn, server_side=True) as tls:
                while not self.closed.is_set():  # keep-alive: one request after another
                    head = b""
                    while b"\r\n\r\n" not in head:
                        data = tls.recv(4096)
                        if not data:
                            return
                        head += data
                    path = head.split(b" ", 2)[1].decode()
                    self.paths.append(path)
                    self.sent.append(0)
                    self._reply(self, tls, path)
        except OSError:
            pass
        finally:
            conn.close()

    def send(self, tls: ssl.SSLSocket, data: bytes) -> None:
        tls.sendall(data)
        self.sent[-1] += len(data)

    def json(self, tls: ssl.SSLSocket, body: Any, status: str = "200 OK") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        self.send(tls, f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)

    def chunked(self, tls: ssl.SSLSocket, first: bytes, more: Iterator[bytes]) -> None:
        """A chunked 200 reply: `first`, then `more` until it ends or the server closes."""
        self.send(tls, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        for data in _chain(first, more):
            if self.closed.is_set():
                return
            self.send(tls, b"%x\r\n%s\r\n" % (len(data), data))
        self.send(tls, b"0\r\n\r\n")

    def kubeconfig(self, path: Path) -> Path:
        ca = base64.b64encode(self.ca.cert_pem.bytes()).decode()
        cluster = {"server": f"https://127.0.0.1:{self.port}", "certificate-authority-data": ca}
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": cluster}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        }))  # fmt: skip
        return path

    def close(self) -> None:
        self.closed.set()
        self._listener.close()


def _chain(first: bytes, more: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from more


def endless(piece: bytes, *, total: int) -> Iterator[bytes]:
    """`piece` over and over: `total` bytes (a bound for the test's sake; far over any cap)."""
    for _ in range(total // len(piece)):
        yield piece


def trickle(server: Raw, tls: ssl.SSLSocket, data: bytes, every: float = 0.1) -> None:
    for byte in data:
        if server.closed.is_set():
            return
        server.send(tls, bytes([byte]))
        time.sleep(every)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Raw]]:
    servers: list[Raw] = []

    def start(reply: Callable[[Raw, ssl.SSLSocket, str], None], **kwargs: Any) -> Raw:
        servers.append(Raw(reply, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def list_once(server: Raw, tmp_path: Path, settings: kube.Settings = SHORT) -> BaseException:
    """What `kube.list_once` of Services raised (within 60 s: a hang fails the test)."""
    outcome: list[BaseException] = []

    def body() -> None:
        try:
            with kube.connect(kubeconfig=server.kubeconfig(tmp_path / "kc"), context=None) as api:
                kube.list_once(api, (SERVICE,), node_name="node-a", sink=Tracker(),
                               settings=settings)  # fmt: skip
        except BaseException as exc:
            outcome.append(exc)
            return
        outcome.append(AssertionError("listed without an error"))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert outcome, "list_once still running after 60 s"
    return outcome[0]


# ---- lists: bounded in size and time --------------------------------------------------------


def endless_list(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
    item = json.dumps({"metadata": {"name": "x" * 1000, "namespace": "n"}}).encode() + b","
    server.chunked(tls, b'{"kind":"ServiceList","items":[', endless(item, total=200 * MiB))


def test_a_list_response_that_never_ends_is_cut_at_the_page_cap(serve, tmp_path):
    """Before: the whole 200 MiB was read into memory (9.8 GB in 30 s against a real one)."""
    server = serve(endless_list)
    error = list_once(server, tmp_path, CAPPED)
    assert isinstance(error, ApiUnavailable), repr(error)
    assert "over 1 MiB" in str(error)
    assert max(server.sent) < 32 * MiB  # the cap plus what the sockets' buffers held


def test_a_content_length_over_the_cap_is_refused_before_reading(serve, tmp_path):
    server = serve(lambda s, tls, path: s.json(tls, b"[" + b"1," * MiB + b"1]"))
    error = list_once(server, tmp_path, CAPPED)
    assert isinstance(error, ApiUnavailable), repr(error)
    assert "response of 2 MiB, over 1 MiB" in str(error)


def test_endless_pages_are_cut_at_the_list_cap(serve, tmp_path):
    """Every page fine, each with a continue token: the whole list is capped too."""

    def pages(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
        final = len(server.paths) > 400  # before: listed all 400 pages (~40 MiB) and succeeded
        item = {"metadata": {"name": "x" * 100_000, "namespace": "n"}}
        meta = {"resourceVersion": "5", **({} if final else {"continue": "more"})}
        server.json(tls, {**EMPTY, "metadata": meta, "items": [item]})

    server = serve(pages)
    error = list_once(server, tmp_path, CAPPED)
    assert isinstance(error, ApiUnavailable), repr(error)
    assert "over" in str(error)
    assert len(server.paths) < 60


@pytest.mark.parametrize(
    "phase",
    ["headers", "body"],
)
def test_a_server_trickling_one_byte_at_a_time_is_cut_at_the_list_deadline(serve, tmp_path, phase):
    """Each byte comes well within the read timeout; the list's deadline cuts it (before:
    `diff --kubeconfig` hung for ever)."""
    body = json.dumps(EMPTY).encode()
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Slow: " % len(body)

    def slow(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
        if phase == "body":
            server.send(tls, head + b"x\r\n\r\n")
            trickle(server, tls, body)
        else:
            trickle(server, tls, head + b"x" * 60_000)

    server = serve(slow)
    started = time.monotonic()
    error = list_once(server, tmp_path)
    assert isinstance(error, ApiUnavailable), repr(error)
    assert "no complete answer within 1.5s" in str(error)
    # cut at the list's deadline (1.5 s), not when the trickle ends (minutes)
    assert time.monotonic() - started < 60


def test_the_deadline_also_cuts_a_connection_reused_from_the_pool(serve, tmp_path):
    """`diff` lists Services (at once; the connection goes back to the pool), then
    EndpointSlices on that same connection, which trickle: cut at that list's deadline."""

    def reply(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
        body = json.dumps(EMPTY).encode()
        if "/services" in path:
            server.json(tls, body)
            return
        server.send(tls, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        trickle(server, tls, body)

    server = serve(reply)
    started = time.monotonic()
    api = kube.connect(kubeconfig=server.kubeconfig(tmp_path / "kc"), context=None)
    with api, pytest.raises(ApiUnavailable, match="EndpointSlices .* no complete answer within"):
        kube.list_once(api, (SERVICE, SLICE), node_name="node-a", sink=Tracker(), settings=SHORT)
    assert time.monotonic() - started < 60  # the deadline (1.5 s), not the trickle's end
    assert len(server.paths) == 2
    assert server.connections == 1


# ---- pages over the cap: asked for again, smaller (issue 28's closing note) -----------------


def service(name: str, padding: int = 0) -> dict[str, Any]:
    """A Service, `padding` bytes larger by an annotation."""
    meta: dict[str, Any] = {"name": name, "namespace": "n"}
    if padding:
        meta["annotations"] = {"padding": "x" * padding}
    spec = {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]}
    return {"kind": "Service", "apiVersion": "v1", "metadata": meta, "spec": spec}


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = ApiServer().start()
    yield server
    server.stop()


def lists(server: ApiServer) -> list[dict[str, str]]:
    """The queries of the list requests the server got, in order."""
    return [query for _, _, query in server.requests if "watch" not in query]


def test_pages_over_the_cap_are_asked_for_again_smaller_from_the_same_list(api, tmp_path, caplog):
    """A legitimate list whose pages of 500 are over the page cap (EndpointSlices of 1,000
    endpoints do that at 64 MiB): each page over it is asked for again from the same continue
    token with half the limit; the list completes with every object. Before: the list failed
    on that page, and the watcher retried it with the same limit for ever."""
    for i in range(600):
        api.put(service(f"a{i:03}"))  # ~300 bytes each: a page of 500 is ~150 KiB
    for i in range(20):
        api.put(service(f"b{i:02}", padding=20 * KiB))  # a page with them all is over 256 KiB
    cap = 256 * KiB
    settings = replace(SHORT, max_page_bytes=cap, list_deadline=10, read_timeout=5)
    tracker = Tracker()
    caplog.set_level(logging.INFO, logger="ipvsproxy.kube")
    with kube.connect(kubeconfig=api.write_kubeconfig(tmp_path / "kc"), context=None) as client:
        watcher = kube.Watcher(
            SERVICE, api=client, node_name="node-a", sink=tracker, stop=threading.Event(),
            settings=settings,
        )  # fmt: skip
        watcher.list_all()
        queries = lists(api)
        watcher.list_all()  # a list that worked: the next one starts at 500 again
    assert len(tracker.views(SERVICE)) == 620
    assert lists(api)[len(queries)] == {"limit": "500"}
    # what the server answered each request (it is unchanged meanwhile: the same answers)
    refused_mid_list = 0
    for n, query in enumerate(queries):
        code, body = api.list_page("Service", dict(query))
        assert code == 200
        following = queries[n + 1] if n + 1 < len(queries) else None
        if len(json.dumps(body).encode()) > cap:  # refused: the same page, half as large
            assert following == {**query, "limit": str(int(query["limit"]) // 2)}
            refused_mid_list += "continue" in query
        elif "continue" in body["metadata"]:  # the next page of the same list, the same size
            assert following == {**query, "continue": body["metadata"]["continue"]}
        else:
            assert following is None
    assert refused_mid_list >= 1  # a page after the first was refused too
    assert [q["limit"] for q in queries][:3] == ["500", "500", "250"]
    assert re.search(r"listed 620 Services at resourceVersion \d+ in pages of \d+", caplog.text)


def test_a_page_of_one_object_over_the_cap_is_a_clear_error_after_bounded_retries(api, tmp_path):
    """One object larger than the page cap: halved down to a page of one, then one line
    naming the resource and the cap. Before: "response of 2 MiB, over 1 MiB" and no
    smaller page ever asked for."""
    api.put(service("a"))
    api.put(service("b", padding=2 * MiB))
    api.put(service("c"))
    client = kube.connect(kubeconfig=api.write_kubeconfig(tmp_path / "kc"), context=None)
    # ten requests, two of 2 MiB: a deadline a busy machine cannot miss (it is not tested)
    settings = replace(SHORT, list_deadline=60)
    with client, pytest.raises(ApiUnavailable) as raised:
        kube.list_once(client, (SERVICE,), node_name="node-a", sink=Tracker(), settings=settings)
    assert re.fullmatch(
        rf"cannot read Services from https://127.0.0.1:{api.port}: a page of 1 Service is over "
        r"the 1 MiB page cap, so the list cannot complete \(response of 2[\d.]* MiB, over 1 MiB\)",
        str(raised.value),
    ), str(raised.value)
    # 500 ... 3 hold all three; a page of 1 holds "a"; the next page of 1 is "b"
    limits = ["500", "250", "125", "62", "31", "15", "7", "3", "1", "1"]
    assert [q["limit"] for q in lists(api)] == limits
    assert "continue" in lists(api)[-1]


def test_in_run_a_page_of_one_object_over_the_cap_is_an_error_retried_with_backoff(
    api, watching, caplog
):
    """The watcher keeps running (nothing listed: the agent does not sync, as for any API
    failure); each attempt is the same bounded series of smaller pages, then an error line
    naming the resource and the cap, then a backoff. Before: a warning, and the same page
    of 500 asked for again."""
    api.put(service("a"))
    api.put(service("b", padding=2 * MiB))
    caplog.set_level(logging.WARNING, logger="ipvsproxy.kube")
    run = watching(api)
    eventually(lambda: len(run.restarts) >= 3, 15, detail=lambda: repr(run.error))
    assert run.thread.is_alive()
    assert run.error is None
    run.close()
    assert not run.tracker.synced()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == len(run.restarts)
    assert all(
        re.fullmatch(r"watch Service from https://\S+: a page of 1 Service is over the 1 MiB "
                     r"page cap, so the list cannot complete \(response of 2[\d.]* MiB, over "
                     r"1 MiB\); retrying in [\d.]+s", error)
        for error in errors
    ), errors  # fmt: skip
    # every attempt the same bounded series; a new one only after a logged backoff
    attempts = " ".join(q["limit"] for q in lists(api)).replace(" 500", "\n500").splitlines()
    assert set(attempts[:-1]) == {"500 250 125 62 31 15 7 3 1 1"}
    assert len(attempts) <= len(run.restarts) + 1


# ---- garbage: diff exits 2 with one line; run's watcher warns and retries -------------------

GARBAGE = {
    "a JSON array": b"[1,2,3]",
    "metadata a string": b'{"metadata":"x"}',
    "an empty object": b"{}",  # never an empty list: that would delete every Service
    "items not a list": b'{"metadata":{"resourceVersion":"5"},"items":{"a":1}}',
    "continue not a string": b'{"metadata":{"resourceVersion":"5","continue":7},"items":[]}',
    "a JSON string": b'"x"',
    "not JSON": b"<html>hello</html>",
    "nested past the recursion limit": b"[" * 100_000 + b"]" * 100_000,
    "invalid UTF-8": b'{"items": "\xff\xfe"}',
}


@pytest.mark.parametrize("body", GARBAGE.values(), ids=GARBAGE.keys())
def test_diff_on_a_garbage_list_reply_exits_2_with_one_line(serve, tmp_path, body):
    """Before: an AttributeError traceback (or an empty list), exit 1 ("changes pending")."""
    server = serve(lambda s, tls, path: s.json(tls, body))
    assert_diff_fails(server, tmp_path, f"https://127.0.0.1:{server.port}")


def silent(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
    server.closed.wait(30)


def not_http(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
    server.send(tls, b"hello, this is not HTTP\r\n\r\n")


def endless_error(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
    head = b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n\r\n"
    server.send(tls, head)
    for piece in endless(b"x" * 65536, total=200 * MiB):
        if server.closed.is_set():
            return
        server.send(tls, b"%x\r\n%s\r\n" % (len(piece), piece))


UNREACHABLE: dict[str, tuple[Callable[..., None], dict[str, Any], str]] = {
    "refused port": (silent, {}, "refused"),
    "certificate of another CA": (silent, {"foreign": True}, "TLS: "),
    # the read timeout (1 s) comes first, unless a slow TLS handshake leaves the deadline first
    "silent server": (silent, {}, "timed out|no complete answer within 1.5s"),
    "not HTTP": (not_http, {}, "not an HTTP reply"),
    "trickling server": (
        lambda s, tls, p: trickle(s, tls, b"HTTP/1.1 200 OK\r\n" * 100),
        {},
        "no complete answer within 1.5s",
    ),  # fmt: skip
    "endless list": (endless_list, {}, "over 1 MiB"),
    "endless error body": (endless_error, {}, "500"),
}


@pytest.mark.parametrize("case", UNREACHABLE.keys())
def test_diff_on_an_api_it_cannot_use_exits_2_with_one_line(serve, tmp_path, monkeypatch, case):
    """Before: a traceback and exit 1 (refused, TLS, not HTTP), or a hang (silent, trickling,
    endless)."""
    reply, kwargs, reason = UNREACHABLE[case]
    server = serve(reply, **kwargs)
    if case == "refused port":
        server.close()
        bound = socket.socket()  # bound, never listening: a connection to it is refused
        bound.bind(("127.0.0.1", 0))
        server.port = bound.getsockname()[1]
    monkeypatch.setattr(kube, "DIFF", CAPPED if case.startswith("endless") else SHORT)
    stderr = assert_diff_fails(server, tmp_path, f"https://127.0.0.1:{server.port}")
    assert re.search(reason, stderr), stderr
    if case == "refused port":
        bound.close()


def test_diff_on_a_refusal_with_a_hostile_message_exits_2_with_one_escaped_line(serve, tmp_path):
    """A 401 whose Status message holds newlines and an escape sequence: still one line, the
    control characters shown as escapes."""
    status = {"kind": "Status", "code": 401, "message": "no\nforged: line \x1b[31mred"}
    server = serve(lambda s, tls, path: s.json(tls, status, "401 Unauthorized"))
    kc = str(server.kubeconfig(tmp_path / "kc"))
    result = CliRunner().invoke(main, ["diff", "--kubeconfig", kc, "--kernel-state", str(STATE),
                                       *NODE])  # fmt: skip
    assert result.exit_code == 2, (result.output, result.exception)
    (line,) = result.stderr.splitlines()
    assert "401 no forged: line \\x1b[31mred" in line
    assert "\x1b" not in line


def test_diff_against_a_name_that_never_resolves_exits_2_with_one_line_at_the_deadline(
    tmp_path, monkeypatch
):
    """The lookup of the server's name blocks (a name server that never answers): `diff`
    gives up at the list's deadline, as for a server that never answers. Before: it waited
    for the lookup, for ever (getaddrinfo has no timeout, and the deadline cut sockets only)."""
    kc = tmp_path / "kc"
    kc.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://api.nowhere.test:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }))  # fmt: skip
    monkeypatch.setattr(kube, "DIFF", SHORT)
    with never_resolving("api.nowhere.test") as lookups:
        started = time.monotonic()
        line = diff_fails(kc, "https://api.nowhere.test:6443")
        # the deadline, not the lookup that never ends
        assert time.monotonic() - started < 60
    assert lookups  # the resolver was asked, and blocked
    eventually(lambda: not connecting(), 5)  # the lookup, unblocked, ended its worker
    assert line.endswith(
        ": no connection to api.nowhere.test:6443 before the 1.5s deadline "
        "(name resolution, connect or TLS handshake still under way)"
    ), line


def assert_diff_fails(server: Raw, tmp_path: Path, host: str) -> str:
    return diff_fails(server.kubeconfig(tmp_path / "kc"), host)


def diff_fails(kubeconfig: Path, host: str) -> str:
    """`diff --kubeconfig` of `host`'s Services: exit 2 and one line on stderr (within 60 s: a
    hang fails the test, whatever the machine's load)."""
    kc = str(kubeconfig)
    outcome: list[Any] = []
    runner = threading.Thread(
        target=lambda: outcome.append(CliRunner().invoke(
            main, ["diff", "--kubeconfig", kc, "--kernel-state", str(STATE), *NODE])),
        daemon=True,
    )  # fmt: skip
    runner.start()
    runner.join(timeout=60)
    assert outcome, "diff still running after 60 s"
    result = outcome[0]
    assert "Traceback" not in result.output
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ipvsproxy: error: cannot read Services from {host}: "), lines
    return str(lines[0])


# ---- run: the watcher retries with backoff and keeps running --------------------------------


class Watching:
    def __init__(self, server: Raw | ApiServer, tmp_path: Path) -> None:
        self.tracker = Tracker(required=(SERVICE,))
        self.restarts: list[tuple[str, str]] = []
        self.stop = threading.Event()
        kc = (server.kubeconfig if isinstance(server, Raw) else server.write_kubeconfig)(
            tmp_path / "kc"
        )
        self.client = kube.connect(kubeconfig=kc, context=None)
        self.watcher = kube.Watcher(
            SERVICE, api=self.client, node_name="node-a", sink=self.tracker, stop=self.stop,
            settings=SHORT, on_restart=lambda kind, reason: self.restarts.append((kind, reason)),
        )  # fmt: skip
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._body, daemon=True)
        self.thread.start()

    def _body(self) -> None:
        try:
            self.watcher.run()
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.client.close()


@pytest.fixture
def watching(tmp_path: Path) -> Iterator[Callable[[Raw | ApiServer], Watching]]:
    started: list[Watching] = []

    def start(server: Raw | ApiServer) -> Watching:
        started.append(Watching(server, tmp_path))
        return started[-1]

    yield start
    for run in started:
        run.close()


def watches(server: Raw) -> list[int]:
    """The bytes sent on each watch request so far."""
    return [n for path, n in zip(server.paths, server.sent, strict=False) if "watch=true" in path]


def test_a_watch_line_without_a_newline_is_cut_and_the_watcher_retries(serve, watching, caplog):
    """Before: each stream was read whole into memory (the agent grew ~23 MB/s)."""

    def reply(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
        if "watch=true" not in path:
            server.json(tls, EMPTY)
        else:
            server.chunked(
                tls, b'{"type":"ADDED","object":{"x":"', endless(b"y" * 65536, total=64 * MiB)
            )

    server = serve(reply)
    caplog.set_level(logging.WARNING, logger="ipvsproxy.kube")
    run = watching(server)
    eventually(lambda: len(watches(server)) >= 3, 15, detail=lambda: repr(run.error))
    assert run.error is None
    assert run.thread.is_alive()
    assert max(watches(server)[:-1]) < 32 * MiB  # each stream given up at the 256 KiB cap
    assert (SERVICE, "error") in run.restarts
    assert "an event over 256 KiB without its newline" in caplog.text


def test_a_trickling_watch_stream_is_cut_after_its_timeout_and_resumed(serve, watching, caplog):
    """Bytes every 0.1 s (within every read timeout) that never make an event: cut once the
    stream outlives the timeout it was asked for by the inactivity timeout."""

    def reply(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
        if "watch=true" not in path:
            server.json(tls, EMPTY)
            return
        server.send(tls, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not server.closed.is_set():
            server.send(tls, b"1\r\n \r\n")
            time.sleep(0.1)

    server = serve(reply)
    caplog.set_level(logging.WARNING, logger="ipvsproxy.kube")
    run = watching(server)
    eventually(lambda: len(watches(server)) >= 2, 12, detail=lambda: caplog.text)
    assert run.error is None
    assert run.thread.is_alive()
    assert "stream still open" in caplog.text


def test_garbage_list_replies_are_warnings_and_retries_never_an_exit(serve, watching, caplog):
    """Before: `[1,2,3]` or `{"metadata":"x"}` raised AttributeError in the watcher, which
    stopped the agent (exit 2)."""
    replies = [*GARBAGE.values(), json.dumps(EMPTY).encode()]

    def reply(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
        if "watch=true" in path:
            server.closed.wait(30)
        else:
            server.json(tls, replies[min(len(server.paths), len(replies)) - 1])

    server = serve(reply)
    caplog.set_level(logging.WARNING, logger="ipvsproxy.kube")
    run = watching(server)
    eventually(run.tracker.synced, 15, detail=lambda: f"{run.error!r}\n{caplog.text}")
    assert run.error is None
    assert run.thread.is_alive()
    assert run.restarts.count((SERVICE, "error")) == len(GARBAGE)
    assert "not a ServiceList" in caplog.text
    assert "retrying in" in caplog.text


def test_garbage_watch_events_are_warnings_and_retries(serve, watching, caplog):
    events = [
        b'{"type":"ADDED","object":{"metadata":"x"}}',  # before: AttributeError, agent stopped
        b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":["x"]}}}',
        b"[1,2,3]",
        b'{"type":"ADDED","object":"x"}',
    ]

    def reply(server: Raw, tls: ssl.SSLSocket, path: str) -> None:
        if "watch=true" not in path:
            server.json(tls, EMPTY)
        else:
            server.chunked(tls, b"\n".join(events) + b"\n", iter(()))

    server = serve(reply)
    caplog.set_level(logging.WARNING, logger="ipvsproxy.kube")
    run = watching(server)
    eventually(lambda: len(watches(server)) >= 3, 15, detail=lambda: repr(run.error))
    assert run.error is None
    assert run.thread.is_alive()
    assert "unreadable event" in caplog.text
    resumed = {path.split("resourceVersion=")[1].split("&")[0] for path in server.paths
               if "watch=true" in path}  # fmt: skip
    assert resumed == {"5"}  # a version that is not a string is not resumed from


@pytest.mark.parametrize("address", ["", "ftp://x", "https://127.0.0.1:99999", "https://exa mple"])
def test_a_server_address_no_request_could_use_is_one_config_error(tmp_path, address):
    """Before: `run` retried it for ever, `diff` printed urllib3's words (with a
    FutureWarning for an empty one)."""
    server = Raw(silent)
    try:
        kc = server.kubeconfig(tmp_path / "kc")
    finally:
        server.close()
    doc = json.loads(kc.read_text())
    doc["clusters"][0]["cluster"]["server"] = address
    kc.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["diff", "--kubeconfig", str(kc), "--kernel-state",
                                       str(STATE), *NODE])  # fmt: skip
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == f"ipvsproxy: error: the kubeconfig's server {address!r} is not an " \
                            "http(s) URL with a host\n"  # fmt: skip


def test_diff_exits_2_even_on_a_bug(monkeypatch):
    """Exit 1 means "changes pending": an unexpected exception (a bug) is its traceback and
    exit 2, never Python's exit 1."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("ipvsproxy.agent.diff", broken)
    result = CliRunner().invoke(main, ["diff", "--kubeconfig", "/nonexistent", *NODE])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "ipvsproxy: error: internal error (a bug; the traceback is above): RuntimeError('boom')"
    )
