"""The API client: the `kubernetes` library's configuration, and plain GETs through its HTTP layer.

Owns `client()`, which configures the library from a kubeconfig file (`load_kube_config`) or
from the Pod's service account (`load_incluster_config`) and maps any failure to one
`ConfigError` line, and `Client`, which sends GETs through the library's `RESTClientObject`
(TLS, client certificates, proxy, the connection pool: all from the `Configuration`). It
re-exports the other library piece `ipvsproxy.kube` needs (`ApiException`; watch streams are
split into lines by `ipvsproxy.kube` itself, with a cap on a line's length).

Everything a kubeconfig can say (tokens, token files, client certificates, user and
password, exec plugins, auth providers, several files in `$KUBECONFIG`) is the library's to
read. `Client.get` takes the authorization header from `Configuration.auth_settings()` on
every request: that runs the loaders' refresh hook, which re-reads a rotated in-cluster
service-account token and renews an exec plugin's expired one. The generated API classes are
not used: they build model objects for every response, and `ipvsproxy.kube` reads raw JSON.

Key material never lands on disk. The library writes every `*-data` field of a kubeconfig
(`client-key-data`, `client-certificate-data`, `certificate-authority-data`, and an exec
plugin's `clientKeyData`) to a temp file, which ssl then loads by name on every new
connection; it removes them only at a clean exit, so after `kill -9` the client's private
key stayed in /tmp. `client()` first replaces the library's one writer of those files
(`kube_config._create_temp_file_with_content`, a private function: the one exception to not
patching other packages, for this reason; tests/test_kubeclient.py fails if it moves) with
`_memory_file()`: an anonymous memory file (memfd_create), named to ssl as /proc/self/fd/N,
mode 0600, gone with the process however it ends.

Every request is reported to `observe(method, host, code, seconds)` (the agent's
rest_client_* metrics, as client-go reports its own): `code` is the HTTP status or `<error>`
when none came, `host` the server's host:port, `seconds` the time to the response headers
(the body is streamed afterwards), None for a watch, which client-go does not time.

A request can be given a `Deadline`: a time after which every socket the calling thread
opened or reused for it is shut down, whatever phase it is in (TLS handshake, headers, body).
A per-read socket timeout alone cannot cut a server that trickles one byte at a time: each
read returns in time, and the request never ends. Before there is a socket, the name of the
server is resolved and the connection made (urllib3's `_new_conn`) on a worker thread that the
request waits for until the deadline: `getaddrinfo` has no timeout and nothing to shut down.

Must not import: anything of ipvsproxy but `errors`.
Imports: kubernetes (client, config), urllib3, yaml, errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import yaml
from kubernetes import __version__ as LIBRARY_VERSION
from kubernetes.client import Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import RESTClientObject
from kubernetes.config import ConfigException, kube_config, load_incluster_config
from urllib3.exceptions import ConnectTimeoutError, LocationParseError
from urllib3.util import parse_url

from ipvsproxy.errors import ConfigError

__all__ = [
    "ApiException",
    "Client",
    "Deadline",
    "Observe",
    "client",
    "unobserved",
]

Observe = Callable[[str, str, str, float | None], None]
log = logging.getLogger(__name__)


def unobserved(method: str, host: str, code: str, seconds: float | None) -> None:
    """The default `observe`: requests are not reported."""


class Client:
    """GETs from the API server, as the generated API classes send them."""

    def __init__(self, configuration: Any, *, observe: Observe = unobserved) -> None:
        self.configuration = configuration
        self._rest = RESTClientObject(configuration)
        _watch_connections(self._rest.pool_manager)
        self._user_agent = f"ipvsproxy (kubernetes-client-python {LIBRARY_VERSION})"
        self._observe = observe
        self._host = urlsplit(configuration.host).netloc  # client-go's label: URL.Host

    def get(self, path: str, query: list[tuple[str, Any]], *, timeout: Any = None) -> Any:
        """The `RESTResponse` (status, undecoded body) of GET `path?query`."""
        pairs = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in query]
        url = self.configuration.host + path
        if pairs:
            url += "?" + urlencode(pairs, quote_via=quote, safe="/")
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        for auth in self.configuration.auth_settings().values():  # runs the refresh hook
            if auth["in"] == "header" and auth["value"]:
                # strip: the library keeps a token file's trailing newline, which no header
                # may carry (kubectl and client-go trim it too)
                headers[auth["key"]] = auth["value"].strip()
        watch = ("watch", "true") in pairs
        started = time.monotonic()
        try:
            response = self._rest.request(  # type: ignore[no-untyped-call]
                "GET", url, headers=headers, _request_timeout=timeout
            )
        except Exception:
            self._observe("GET", self._host, "<error>", None if watch else _since(started))
            raise
        self._observe("GET", self._host, str(response.status), None if watch else _since(started))
        return response

    def close(self) -> None:
        self._rest.pool_manager.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_active = threading.local()  # .deadline: the Deadline of the request this thread is making


class Deadline:
    """`with Deadline(seconds) as d:` around a request and the reading of its body: once
    `seconds` pass, every connection this thread used inside the block is shut down (a
    blocked read then fails or ends at once) and `d.expired` is true.

    A timer thread does the cutting; the sockets are known through `_Watched`, the mixin
    `Client` puts into its connection classes. Each is held as a duplicate descriptor, so
    cutting never touches a descriptor number that has since been reused.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._done = False
        self._previous: Deadline | None = None
        self._end = time.monotonic() + seconds
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._previous = getattr(_active, "deadline", None)
        _active.deadline = self
        self._end = time.monotonic() + self.seconds
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        _active.deadline = self._previous
        with self._lock:
            self._done = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    def watch(self, sock: Any) -> None:
        """Cut `sock` (a socket, or what stands for one: urllib3's TLS-in-TLS transport)
        too when the time is up (at once if it is up already)."""
        with self._lock:
            if self._done:
                return
            try:  # family and type are read from the descriptor
                dup = socket.socket(fileno=os.dup(sock.fileno()))
            except (OSError, AttributeError, ValueError):  # closed meanwhile: nothing to cut
                return
            self._sockets.append(dup)
            if self.expired:
                _cut(dup)

    def connect(self, new_conn: Callable[[], socket.socket]) -> socket.socket:
        """`new_conn()` (urllib3's: resolve the server's name, then connect) on a worker
        thread, waited for until the time is up; then the deadline expires (as the timer
        would a moment later) and this raises `TimeoutError`.

        Why a thread: `getaddrinfo` blocks in the C library with no timeout of ours and no
        socket to shut down (glibc asks each name server for `timeout` x `attempts` seconds;
        an NSS module, LDAP or sssd, may block for far longer), so nothing else can end it
        at the deadline. A worker still resolving is left to finish by itself: a daemon
        thread, it never holds up the process's exit; a socket it makes too late is closed.
        At most `_WORKERS` run at once, so a resolver that never answers costs that many
        threads, not one per attempt: past that, a connection waits for a free one within
        its own deadline.
        """
        left = self._end - time.monotonic()
        if self.expired or left <= 0 or not _workers.acquire(timeout=left):
            self._expire()
            raise TimeoutError("no worker free to connect")
        attempt = _Attempt(new_conn)
        threading.Thread(target=attempt.run, name="ipvsproxy-connect", daemon=True).start()
        sock = attempt.wait(self._end - time.monotonic())
        if sock is None:
            self._expire()
            raise TimeoutError("name resolution or connect still under way")
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _cut(sock)


_WORKERS = 8  # connections being made on worker threads at once (`Deadline.connect`)
_workers = threading.BoundedSemaphore(_WORKERS)


class _Attempt:
    """One `new_conn()` on a worker thread, which a waiter may give up on."""

    def __init__(self, new_conn: Callable[[], socket.socket]) -> None:
        self._new_conn = new_conn
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._abandoned = False
        self._sock: socket.socket | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            sock = self._new_conn()
        except BaseException as exc:  # handed to the waiter, raised there
            with self._lock:
                self._error = exc
        else:
            with self._lock:
                if self._abandoned:
                    sock.close()  # too late: nobody will use it
                else:
                    self._sock = sock
        finally:
            _workers.release()
            self._finished.set()

    def wait(self, seconds: float) -> socket.socket | None:
        """The socket, or None if not made within `seconds` (then given up on); `new_conn`'s
        own error is raised here."""
        self._finished.wait(max(seconds, 0))
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._sock is None:
                self._abandoned = True
            return self._sock


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # on a duplicate: the TLS object is left alone


class _Watched:
    """A urllib3 connection whose socket the thread's active `Deadline` may cut: the new
    socket before its TLS handshake, a pooled one when it is reused for a request."""

    sock: socket.socket | None
    host: str
    port: int | None

    def _new_conn(self) -> socket.socket:
        new_conn: Callable[[], socket.socket] = super()._new_conn  # type: ignore[misc]
        deadline: Deadline | None = getattr(_active, "deadline", None)
        if deadline is None:
            return new_conn()
        try:
            sock = deadline.connect(new_conn)
        except TimeoutError as exc:  # as urllib3 says a connect timed out
            raise ConnectTimeoutError(
                self,
                f"no connection to {self.host}:{self.port} before the {deadline.seconds:g}s "
                f"deadline ({exc})",
            ) from exc
        deadline.watch(sock)
        return sock

    def request(self, *args: Any, **kwargs: Any) -> None:
        if self.sock is not None:
            _watched(self.sock)
        super().request(*args, **kwargs)  # type: ignore[misc]


def _watched(sock: Any) -> None:
    deadline: Deadline | None = getattr(_active, "deadline", None)
    if deadline is not None:
        deadline.watch(sock)


def _watch_connections(manager: Any) -> None:
    """Give `manager`'s pools (plain, TLS, SOCKS: whatever the library chose) connections
    that a `Deadline` can cut."""
    manager.pool_classes_by_scheme = {
        scheme: type(
            pool.__name__,
            (pool,),
            {
                "ConnectionCls": type(
                    pool.ConnectionCls.__name__, (_Watched, pool.ConnectionCls), {}
                )
            },
        )
        for scheme, pool in manager.pool_classes_by_scheme.items()
    }


def _since(started: float) -> float:
    return time.monotonic() - started


def client(
    *,
    kubeconfig: Path | None,
    context: str | None,
    master: str | None = None,
    origin: str = "--kubeconfig",
    observe: Observe = unobserved,
) -> Client:
    """A `Client`: `kubeconfig` if given, else in-cluster, else the default kubeconfig
    (`$KUBECONFIG`, else ~/.kube/config). `master` (kube-proxy's --master) overrides the
    server's address; without a kubeconfig it is the whole configuration, as kube-proxy's
    `createClient` makes it (no in-cluster credentials). `origin` is how an error names
    where `kubeconfig` came from (--kubeconfig, or a --config file's field).

    The caller closes it (`.close()`). urllib3's own retries are off: the watch loop retries
    with backoff itself, and a hidden retry would only delay seeing a failure.
    """
    _keep_key_material_in_memory()
    configuration = Configuration()
    if kubeconfig is not None:
        if not kubeconfig.is_file():
            # "--kubeconfig PATH", or "--config FILE: field clientConnection.kubeconfig: PATH"
            sep = " " if origin == "--kubeconfig" else ": "
            raise ConfigError(f"{origin}{sep}{kubeconfig}: no such file")
        named = str(kubeconfig) if origin == "--kubeconfig" else f"{origin}: {kubeconfig}"
        _load_kubeconfig(str(kubeconfig), context, configuration, named=named)
    elif not master:
        _check_service_env()
        try:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError) as in_cluster:
            # not in a Pod (no KUBERNETES_SERVICE_HOST), or no service-account token mounted
            _load_kubeconfig(None, context, configuration, also=f"in-cluster: {in_cluster}")
    if master:
        # client-go's DefaultServerURL: a bare host:port means https
        configuration.host = (master if "://" in master else f"https://{master}").rstrip("/")
    _check_server(configuration.host, "--master" if master else "the kubeconfig's server")
    configuration.retries = 0
    return Client(configuration, observe=observe)


# The in-cluster address's variables and the keys of ipvsproxy's ConfigMap the DaemonSet sets
# them from (deploy/base/objects/daemonset.yaml): empty there until the operator sets them
_SERVICE_ENV = (
    ("KUBERNETES_SERVICE_HOST", "apiserver-host"),
    ("KUBERNETES_SERVICE_PORT", "apiserver-port"),
)


def _check_service_env() -> None:
    """An in-cluster address variable set but empty is the DaemonSet's ConfigMap left as
    shipped: a `ConfigError` naming the key to set (the library would only say "Service
    host/port is set but empty")."""
    for name, key in _SERVICE_ENV:
        if os.environ.get(name) == "":
            raise ConfigError(
                f"{name} is set but empty: no API server address. In the DaemonSet it comes "
                f"from key {key!r} of ConfigMap 'ipvsproxy': set it to the API server as "
                "nodes reach it without a Service VIP (or give --kubeconfig or --master)"
            )


def _check_server(host: str, where: str) -> None:
    """A server address no request could use is a `ConfigError` now (`run` would retry it
    for ever; `diff` would fail with urllib3's words)."""
    try:
        url = parse_url(host or "")
        usable = url.scheme in ("http", "https") and bool(url.host)
    except LocationParseError:
        usable = False
    if not usable:
        raise ConfigError(f"{where} {host!r} is not an http(s) URL with a host")


# what the library raises on a document of the wrong shape (a list, a string, a bad base64 field)
_SHAPE = (TypeError, KeyError, AttributeError, ValueError)


def _load_kubeconfig(
    path: str | None,
    context: str | None,
    configuration: Any,
    *,
    also: str = "",
    named: str = "",
) -> None:
    """`load_kube_config`, its failures as one `ConfigError` line (`also`: what failed first;
    `named`: the path as the error names it, with where it came from)."""
    where = named or path or kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    try:
        kube_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, context=context, client_configuration=configuration
        )
    except (ConfigException, OSError, yaml.YAMLError, *_SHAPE) as exc:
        reason = f"{also}; {where}: {_describe(exc)}" if also else f"{where}: {_describe(exc)}"
        raise ConfigError(f"cannot load the Kubernetes client configuration ({reason})") from exc


def _describe(exc: Exception) -> str:
    """The library's error in one line."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"not valid YAML: {exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    if isinstance(exc, _SHAPE):
        return f"not a well-formed kubeconfig ({exc})"
    return " ".join(str(exc).split())


# content -> the memory file holding it (the library's cache does the same with its files:
# a context read again, or an exec plugin's renewed credential, reuses or adds one)
_memory_files: dict[bytes, int] = {}
_memory_lock = threading.Lock()


def _keep_key_material_in_memory() -> None:
    """Have the library write `*-data` fields to memory files, not temp files (see above)."""
    if not hasattr(kube_config, "_create_temp_file_with_content"):
        log.warning(
            "kubernetes %s: cannot keep kubeconfig key material in memory; it may be written "
            "to temp files",
            LIBRARY_VERSION,
        )
        return
    kube_config._create_temp_file_with_content = _memory_file


def _memory_file(
    content: str | bytes, temp_file_path: Any = None, force_recreate: bool = False
) -> str:
    """The library's `_create_temp_file_with_content`, in memory: the path of an anonymous
    file (memfd) holding `content` (`temp_file_path`, `force_recreate`: the library's
    arguments, moot here: nothing is on disk, nothing can vanish)."""
    data = content.encode() if isinstance(content, str) else bytes(content)
    with _memory_lock:
        fd = _memory_files.get(data)
        if fd is None:
            try:
                fd = os.memfd_create("ipvsproxy-kubeconfig", os.MFD_CLOEXEC)
            except OSError as exc:
                raise ConfigError(
                    f"cannot keep the kubeconfig's key material in memory: memfd_create: {exc}"
                ) from exc
            os.fchmod(fd, 0o600)
            with open(fd, "wb", closefd=False) as memory:
                memory.write(data)
            _memory_files[data] = fd
    path = f"/proc/self/fd/{fd}"
    if not os.path.isfile(path):
        raise ConfigError(f"cannot name the kubeconfig's key material to ssl: no {path} (/proc?)")
    return path
