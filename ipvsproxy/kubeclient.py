"""The API client: the `kubernetes` library's configuration, plain requests through its HTTP layer.

Owns `client()`, which configures the library from a kubeconfig file (as `load_kube_config`) or
from the Pod's service account (`load_incluster_config`) and maps any failure to one
`ConfigError` line, and `Client`, which sends GETs (and the POSTs of the secure metrics port's
token and access reviews) through the library's `RESTClientObject`
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
(`client-key-data`, `client-certificate-data`, `certificate-authority-data`) and an exec
plugin's `clientCertificateData`/`clientKeyData` to temp files, which ssl then loads by name
on every new connection; it removes them only at a clean exit, so after `kill -9` the client's
private key stayed in /tmp. So `client()` does what `load_kube_config` does, through the same
public classes (`KubeConfigMerger` reads and merges the files, `KubeConfigLoader` loads the
result), but first puts those fields of the chosen context's cluster and user into anonymous
memory files (memfd_create), named to the library and ssl by their file fields as
/proc/self/fd/N, mode 0600, gone with the process however it ends. An exec plugin that the
user authenticates with is run here first (the library's public `ExecProvider`): a client
certificate it returns goes to memory files the same way and the library does not run it; a
token it returns is left to the library, which runs the plugin a second time (once, at load)
and renews the token when it expires. No private name of the library is read or replaced
(rule 13); the cost is that `client()` follows the library's public classes, not its one
function. Not covered, as it is not a secret: an OIDC auth provider's
`idp-certificate-authority-data`, a CA certificate, still goes to a temp file on refresh.

Credentials follow rotation, whatever the token carries (`Credentials`). The library re-reads
a kubeconfig's `tokenFile` only when the token has an expiry it can read, and the in-cluster
token once a minute; kubelet rotates a projected service-account token by swapping the
volume's files, and a cluster that does not extend tokens' lifetimes
(`--service-account-extend-token-expiration=false`) refuses the old one within the hour. So
the token file (the kubeconfig user's `tokenFile`, or the service account's in-cluster) is
read again whenever it changed (its inode, size or modification time: a `stat` per request),
and client certificate files named by the kubeconfig (`client-certificate`, `client-key`)
likewise: changed, the idle connections are closed, and each new one loads them (as
client-go's transport reloads rotated certificate files). A 401 or 403 reads both again at
once and sends the request once more.

Every request is reported to `observe(method, host, code, seconds)` (the agent's
rest_client_* metrics, as client-go reports its own): `code` is the HTTP status or `<error>`
when none came, `host` the server's host:port, `seconds` the time to the response headers
(the body is streamed afterwards), None for a watch, which client-go does not time.

A request can be given a `Deadline`: a time after which every socket the calling thread
opened or reused for it is shut down, whatever phase it is in (headers, body). A per-read
socket timeout alone cannot cut a server that trickles one byte at a time: each read returns
in time, and the request never ends. A new connection is made (urllib3's public
`HTTPConnection.connect()`: resolve the server's name, connect, the TLS handshake) on a
worker thread that the request waits for until the deadline, and its socket is watched once
it is made: `getaddrinfo` has no timeout and nothing to shut down, and the socket is only
seen by public means once the handshake is done (a worker given up on in the handshake ends
it under the socket's own timeout, then closes the connection).

Must not import: anything of ipvsproxy but `errors`.
Imports: kubernetes (client, config), urllib3, yaml, errors.
"""

from __future__ import annotations

import base64
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
from kubernetes.config import ConfigException, incluster_config, kube_config, load_incluster_config
from kubernetes.config.exec_provider import ExecProvider
from kubernetes.config.kube_config import ConfigNode, KubeConfigLoader, KubeConfigMerger
from urllib3.exceptions import ConnectTimeoutError, LocationParseError
from urllib3.util import parse_url

from ipvsproxy.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "ApiException",
    "Client",
    "Deadline",
    "Observe",
    "client",
    "unobserved",
]

Observe = Callable[[str, str, str, float | None], None]


def unobserved(method: str, host: str, code: str, seconds: float | None) -> None:
    """The default `observe`: requests are not reported."""


class Credentials:
    """The files a client's identity comes from, followed as they rotate (see above): the
    token file, if the user authenticates with one, and client certificate files.

    `follow()` is installed as the configuration's `refresh_api_key_hook`, which
    `Configuration.auth_settings()` runs before every request; `reload()` reads every file
    again whether it changed or not (after a 401 or 403)."""

    def __init__(
        self,
        configuration: Any,
        *,
        token_file: str | None,
        on_rotate: Callable[[], None] = lambda: None,
    ) -> None:
        self._configuration = configuration
        self._token_file = token_file
        self._on_rotate = on_rotate
        # the library's own hook (an exec plugin's renewal, an auth provider's), kept unless
        # the token is the file's: then it would only set the first token again
        self._library_hook = None if token_file else configuration.refresh_api_key_hook
        # files the kubeconfig names (key material of its own is in memory files: unchanging)
        self._cert_files = tuple(
            name
            for name in (configuration.cert_file, configuration.key_file)
            if name and not name.startswith("/proc/self/fd/")
        )
        self._token_seen = _signature(token_file) if token_file else None
        self._certs_seen = tuple(_signature(name) for name in self._cert_files)
        # every watcher's thread asks: one that sees the change seen by another must not send
        # the old token while the other reads the new one
        self._lock = threading.Lock()
        configuration.refresh_api_key_hook = self.follow

    def follow(self, configuration: Any = None) -> None:
        """Read again what changed since it was last read."""
        with self._lock:
            self._follow()

    def _follow(self) -> None:
        if self._library_hook is not None:
            self._library_hook(self._configuration)
        if self._token_file is not None:
            seen = _signature(self._token_file)
            if seen != self._token_seen:
                self._token_seen = seen
                self._read_token()
        certs = tuple(_signature(name) for name in self._cert_files)
        if certs != self._certs_seen:
            self._certs_seen = certs
            log.info("client certificate files changed: new connections use them")
            self._on_rotate()

    def reload(self) -> None:
        """Read the token file again, and make new connections read the certificate files
        again, changed or not (a 401 or 403 came)."""
        with self._lock:
            self._reload()

    def _reload(self) -> None:
        if self._token_file is not None:
            self._token_seen = _signature(self._token_file)
            self._read_token()
        if self._cert_files:
            self._certs_seen = tuple(_signature(name) for name in self._cert_files)
            self._on_rotate()

    def _read_token(self) -> None:
        """The token file's content as the bearer token; an unreadable or empty file keeps
        the token read before (a rotation's swap of files is atomic: it never shows either)."""
        assert self._token_file is not None
        try:
            token = Path(self._token_file).read_text().strip()
        except OSError as exc:
            log.warning("token file %s: %s; the token read before is kept", self._token_file,
                        exc.strerror or exc)  # fmt: skip
            return
        if not token:
            log.warning("token file %s is empty; the token read before is kept", self._token_file)
            return
        self._configuration.api_key["BearerToken"] = f"Bearer {token}"
        self._configuration.api_key_prefix.pop("BearerToken", None)
        log.debug("token file %s read", self._token_file)


def _signature(path: str) -> tuple[int, int, int, int] | None:
    """What tells a changed file from the one read before (through symlinks, so a projected
    volume's swap of its `..data` link counts); None if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Client:
    """GETs (and POSTs) to the API server, as the generated API classes send them."""

    def __init__(
        self,
        configuration: Any,
        *,
        observe: Observe = unobserved,
        token_file: str | None = None,
    ) -> None:
        self.configuration = configuration
        self._rest = RESTClientObject(configuration)
        _watch_connections(self._rest.pool_manager)
        self.credentials = Credentials(
            configuration, token_file=token_file, on_rotate=self._rest.pool_manager.clear
        )
        self._user_agent = f"ipvsproxy (kubernetes-client-python {LIBRARY_VERSION})"
        self._observe = observe
        self._host = urlsplit(configuration.host).netloc  # client-go's label: URL.Host

    def get(self, path: str, query: list[tuple[str, Any]], *, timeout: Any = None) -> Any:
        """The `RESTResponse` (status, undecoded body) of GET `path?query`. A 401 or 403 reads
        the credentials again and sends the request once more (its answer is returned)."""
        pairs = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in query]
        url = self.configuration.host + path
        if pairs:
            url += "?" + urlencode(pairs, quote_via=quote, safe="/")
        watch = ("watch", "true") in pairs
        response = self._send("GET", url, timeout=timeout, timed=not watch)
        if response.status not in (401, 403):
            return response
        _discard(response)
        log.debug("GET %s: %s; reading the credentials again", path, response.status)
        self.credentials.reload()
        return self._send("GET", url, timeout=timeout, timed=not watch)

    def post(self, path: str, body: dict[str, Any], *, timeout: Any = None) -> Any:
        """The `RESTResponse` of POST `path` with the JSON `body` (a TokenReview, a
        SubjectAccessReview: objects the API creates and answers, never stores)."""
        return self._send("POST", self.configuration.host + path, body=body, timeout=timeout)

    def _send(
        self, method: str, url: str, *, body: Any = None, timeout: Any, timed: bool = True
    ) -> Any:
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        if body is not None:
            headers["Content-Type"] = "application/json"  # the library sends it as JSON
        for auth in self.configuration.auth_settings().values():  # runs the refresh hook
            if auth["in"] == "header" and auth["value"]:
                # strip: the library keeps a token file's trailing newline, which no header
                # may carry (kubectl and client-go trim it too)
                headers[auth["key"]] = auth["value"].strip()
        started = time.monotonic()
        try:
            response = self._rest.request(  # type: ignore[no-untyped-call]
                method, url, headers=headers, body=body, _request_timeout=timeout
            )
        except Exception:
            self._observe(method, self._host, "<error>", _since(started) if timed else None)
            raise
        seconds = _since(started) if timed else None
        self._observe(method, self._host, str(response.status), seconds)
        return response

    def close(self) -> None:
        self._rest.pool_manager.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _discard(response: Any) -> None:
    """A refusal's answer is not read (a Status of a few hundred bytes): its connection is
    closed, not returned to the pool."""
    with contextlib.suppress(Exception):
        response.response.close()
        response.response.release_conn()


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

    def connect(self, connect: Callable[[], None], close: Callable[[], None]) -> None:
        """`connect()` (urllib3's `HTTPConnection.connect`: resolve the server's name,
        connect, and for https the TLS handshake) on a worker thread, waited for until the
        time is up; then the deadline expires (as the timer would a moment later), this
        raises `TimeoutError`, and `close()` is run by the worker once `connect()` ends.

        Why a thread: `getaddrinfo` blocks in the C library with no timeout of ours and no
        socket to shut down (glibc asks each name server for `timeout` x `attempts` seconds;
        an NSS module, LDAP or sssd, may block for far longer), so nothing else can end it
        at the deadline. A worker given up on is left to finish by itself (a TLS handshake it
        is in ends with the socket's own timeout): a daemon thread, it never holds up the
        process's exit; a connection it makes too late is closed. At most `_WORKERS` run at
        once, so a resolver that never answers costs that many threads, not one per attempt:
        past that, a connection waits for a free one within its own deadline.
        """
        left = self._end - time.monotonic()
        if self.expired or left <= 0 or not _workers.acquire(timeout=left):
            self._expire()
            raise TimeoutError("no worker free to connect")
        attempt = _Attempt(connect, close)
        threading.Thread(target=attempt.run, name="ipvsproxy-connect", daemon=True).start()
        if not attempt.wait(self._end - time.monotonic()):
            self._expire()
            raise TimeoutError("name resolution, connect or TLS handshake still under way")

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _cut(sock)


_WORKERS = 8  # connections being made on worker threads at once (`Deadline.connect`)
_workers = threading.BoundedSemaphore(_WORKERS)


class _Attempt:
    """One `connect()` on a worker thread, which a waiter may give up on (then `close()`)."""

    def __init__(self, connect: Callable[[], None], close: Callable[[], None]) -> None:
        self._connect = connect
        self._close = close
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._abandoned = False
        self._connected = False
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._connect()
        except BaseException as exc:  # handed to the waiter, raised there
            with self._lock:
                self._error = exc
        else:
            with self._lock:
                too_late, self._connected = self._abandoned, not self._abandoned
            if too_late:
                self._close()  # nobody will use it
        finally:
            _workers.release()
            self._finished.set()

    def wait(self, seconds: float) -> bool:
        """Whether `connect()` ended within `seconds` (if not, it is given up on);
        its own error is raised here."""
        self._finished.wait(max(seconds, 0))
        with self._lock:
            if self._error is not None:
                raise self._error
            self._abandoned = not self._connected
            return self._connected


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # on a duplicate: the TLS object is left alone


class _Watched:
    """A urllib3 connection whose socket the thread's active `Deadline` may cut: a new one
    once connected (`connect`, urllib3's public method, run on a worker thread), a pooled
    one when it is reused for a request (`request`)."""

    sock: Any
    host: str
    port: int | None

    def connect(self) -> None:
        connect: Callable[[], None] = super().connect  # type: ignore[misc]
        deadline: Deadline | None = getattr(_active, "deadline", None)
        if deadline is None:
            connect()
            return
        try:
            deadline.connect(connect, self.close)  # type: ignore[attr-defined]
        except TimeoutError as exc:  # as urllib3 says a connect timed out
            raise ConnectTimeoutError(
                self,
                f"no connection to {self.host}:{self.port} before the {deadline.seconds:g}s "
                f"deadline ({exc})",
            ) from exc
        if self.sock is not None:
            deadline.watch(self.sock)

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
    configuration = Configuration()
    token_file: str | None = None
    if kubeconfig is not None:
        if not kubeconfig.is_file():
            # "--kubeconfig PATH", or "--config FILE: field clientConnection.kubeconfig: PATH"
            sep = " " if origin == "--kubeconfig" else ": "
            raise ConfigError(f"{origin}{sep}{kubeconfig}: no such file")
        named = str(kubeconfig) if origin == "--kubeconfig" else f"{origin}: {kubeconfig}"
        token_file = _load_kubeconfig(str(kubeconfig), context, configuration, named=named)
    elif not master:
        _check_service_env()
        try:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            token_file = incluster_config.SERVICE_TOKEN_FILENAME
        except (ConfigException, OSError) as in_cluster:
            # not in a Pod (no KUBERNETES_SERVICE_HOST), or no service-account token mounted
            token_file = _load_kubeconfig(
                None, context, configuration, also=f"in-cluster: {in_cluster}"
            )
    if master:
        # client-go's DefaultServerURL: a bare host:port means https
        configuration.host = (master if "://" in master else f"https://{master}").rstrip("/")
    _check_server(configuration.host, "--master" if master else "the kubeconfig's server")
    configuration.retries = 0
    return Client(configuration, observe=observe, token_file=token_file)


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
) -> str | None:
    """`load_kube_config`, its failures as one `ConfigError` line (`also`: what failed first;
    `named`: the path as the error names it, with where it came from); the token file the
    user authenticates with, if any."""
    where = named or path or kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    try:
        return _load_in_memory(
            path or kube_config.KUBE_CONFIG_DEFAULT_LOCATION, context, configuration
        )
    except (ConfigException, OSError, yaml.YAMLError, *_SHAPE) as exc:
        reason = f"{also}; {where}: {_describe(exc)}" if also else f"{where}: {_describe(exc)}"
        raise ConfigError(f"cannot load the Kubernetes client configuration ({reason})") from exc


def _load_in_memory(paths: str, context: str | None, configuration: Any) -> str | None:
    """What `load_kube_config(paths, context)` does, through the same public classes
    (`KubeConfigMerger`: the files of a `:`-separated list merged, each entry remembering
    its file for relative paths; `KubeConfigLoader`), with the key material of the context's
    cluster and user moved into memory files first (see above). Returns the token file the
    user authenticates with, if any (`_token_file`)."""
    merger = KubeConfigMerger(paths)  # type: ignore[no-untyped-call]
    config = merger.config
    if config is None:
        raise ConfigException("Invalid kube-config file. No configuration found.")
    token_file = _token_file(config, context)
    _move_key_material(config, context)
    loader = KubeConfigLoader(  # type: ignore[no-untyped-call]
        config_dict=config,
        active_context=context,
        config_base_path=None,
        config_persister=merger.save_changes,
    )
    loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
    return token_file


def _token_file(config: Any, context: str | None) -> str | None:
    """The `tokenFile` of the user `context` (else current-context) names, if the library
    authenticates the user with it (no auth provider, no `token` field: the library's order),
    resolved as the library does (relative to the file the user's entry came from). None
    also for a kubeconfig of the wrong shape: the loader says what is wrong with it."""
    try:
        name = context if context is not None else config["current-context"]
        user_name = config["contexts"].get_with_name(name)["context"].safe_get("user")
        user = config["users"].get_with_name(user_name, safe=True) if user_name else None
        fields = user.safe_get("user") if user is not None else None
    except (ConfigException, *_SHAPE):
        return None
    if user is None or not isinstance(fields, dict):
        return None
    if fields.get("auth-provider") or "token" in fields:
        return None
    path = fields.get("tokenFile")
    if not isinstance(path, str) or not path:
        return None
    base = os.path.abspath(os.path.dirname(user.path)) if user.path is not None else ""
    return os.path.normpath(os.path.join(base, path))


# a `*-data` field (base64) -> the field naming a file, which the library reads instead
_CLUSTER_DATA = {"certificate-authority-data": "certificate-authority"}
_USER_DATA = {"client-certificate-data": "client-certificate", "client-key-data": "client-key"}
# a user with one of these is not authenticated by its exec plugin (the library's order)
_BEFORE_EXEC = ("auth-provider", "token", "tokenFile")


def _move_key_material(config: Any, context: str | None) -> None:
    """In the merged kubeconfig `config`, replace the entries of the cluster and user that
    `context` (else current-context) names, as `KubeConfigLoader` finds them, by copies with
    each non-empty `*-data` field turned into its file field naming a memory file, and an
    exec plugin's client certificate and key likewise (see `_exec_in_memory`). Copies: the
    files' own content is what `save_changes` compares, so nothing of ours is written back."""
    name = context if context is not None else config["current-context"]
    chosen = config["contexts"].get_with_name(name)["context"]
    cluster = config["clusters"].get_with_name(chosen["cluster"])
    _replace(
        config["clusters"],
        cluster,
        "cluster",
        _data_in_memory(cluster["cluster"].value, _CLUSTER_DATA),
    )
    user_name = chosen.safe_get("user")
    if not user_name or not config.safe_get("users"):
        return
    user = config["users"].get_with_name(user_name, safe=True)
    if user is None or not isinstance(user.safe_get("user"), dict):
        return
    fields = _data_in_memory(user["user"].value, _USER_DATA)
    if "exec" in fields and not any(fields.get(key) for key in _BEFORE_EXEC):
        fields = _exec_in_memory(fields, user["user"]["exec"], cluster["cluster"])
    _replace(config["users"], user, "user", fields)


def _replace(entries: Any, entry: Any, key: str, value: dict[str, Any]) -> None:
    """`entry` of the list `entries` replaced by a copy whose `key` is `value`."""
    for index, item in enumerate(entries.value):
        if item is entry or item is entry.value:
            copy = {**entry.value, key: value}
            entries.value[index] = ConfigNode(entry.name, copy, entry.path)  # type: ignore[no-untyped-call]


def _data_in_memory(fields: Any, data_to_file: dict[str, str]) -> Any:
    """A copy of `fields` with each non-empty `*-data` field decoded into a memory file,
    named by the file field instead (the library prefers the data field when both are set,
    and reads nothing for an empty one: left as it is)."""
    if not isinstance(fields, dict):
        return fields  # not a mapping: the library says what is wrong with it
    moved = dict(fields)
    for data, file in data_to_file.items():
        if moved.get(data):
            value = moved.pop(data)
            moved[file] = _memory_file(
                base64.standard_b64decode(value.encode() if isinstance(value, str) else value)
            )
    return moved


def _exec_in_memory(fields: dict[str, Any], plugin: Any, cluster: Any) -> dict[str, Any]:
    """`fields` (a user) with its exec plugin run first, here (the library's public
    `ExecProvider`, as the library runs it): a client certificate and key it returns go to
    memory files, named by the user's file fields instead of the plugin, which the library
    then does not run (it would write them to temp files; it never renews them either). A
    token, or a failure, leaves the user as it is: the library runs the plugin again, and
    renews the token when it expires."""
    base = os.path.abspath(os.path.dirname(cluster.path)) if cluster.path is not None else ""
    try:
        status = ExecProvider(plugin, base, cluster).run()  # type: ignore[no-untyped-call]
    except Exception:  # the library runs it again and reports the failure as it does
        return fields
    cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
    if "token" in status or not (isinstance(cert, str) and cert and isinstance(key, str) and key):
        return fields
    kept = {k: v for k, v in fields.items() if k not in ("exec", "username", "password")}
    return {
        **kept,
        "client-certificate": _memory_file(cert.encode()),
        "client-key": _memory_file(key.encode()),
    }


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


# content -> the memory file holding it (a context read again reuses it)
_memory_files: dict[bytes, int] = {}
_memory_lock = threading.Lock()


def _memory_file(data: bytes) -> str:
    """The path of an anonymous file (memfd, mode 0600) holding `data`: /proc/self/fd/N,
    which ssl opens by name on every new connection, gone with the process however it
    ends."""
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
