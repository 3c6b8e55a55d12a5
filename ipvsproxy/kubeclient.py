"""The API client: the `kubernetes` library's configuration, and plain GETs through its HTTP layer.

Owns `client()`, which configures the library from a kubeconfig file (`load_kube_config`) or
from the Pod's service account (`load_incluster_config`) and maps any failure to one
`ConfigError` line, and `Client`, which sends GETs through the library's `RESTClientObject`
(TLS, client certificates, proxy, the connection pool: all from the `Configuration`). It
re-exports the two other library pieces `ipvsproxy.kube` needs (`ApiException`,
`iter_resp_lines`).

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

Must not import: anything of ipvsproxy but `errors`.
Imports: kubernetes (client, config, watch), yaml, errors.
"""

from __future__ import annotations

import logging
import os
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
from kubernetes.watch.watch import iter_resp_lines

from ipvsproxy.errors import ConfigError

__all__ = ["ApiException", "Client", "Observe", "client", "iter_resp_lines", "unobserved"]

Observe = Callable[[str, str, str, float | None], None]
log = logging.getLogger(__name__)


def unobserved(method: str, host: str, code: str, seconds: float | None) -> None:
    """The default `observe`: requests are not reported."""


class Client:
    """GETs from the API server, as the generated API classes send them."""

    def __init__(self, configuration: Any, *, observe: Observe = unobserved) -> None:
        self.configuration = configuration
        self._rest = RESTClientObject(configuration)
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


def _since(started: float) -> float:
    return time.monotonic() - started


def client(
    *,
    kubeconfig: Path | None,
    context: str | None,
    master: str | None = None,
    observe: Observe = unobserved,
) -> Client:
    """A `Client`: `kubeconfig` if given, else in-cluster, else the default kubeconfig
    (`$KUBECONFIG`, else ~/.kube/config). `master` (kube-proxy's --master) overrides the
    server's address; without a kubeconfig it is the whole configuration, as kube-proxy's
    `createClient` makes it (no in-cluster credentials).

    The caller closes it (`.close()`). urllib3's own retries are off: the watch loop retries
    with backoff itself, and a hidden retry would only delay seeing a failure.
    """
    _keep_key_material_in_memory()
    configuration = Configuration()
    if kubeconfig is not None:
        if not kubeconfig.is_file():
            raise ConfigError(f"--kubeconfig {kubeconfig}: no such file")
        _load_kubeconfig(str(kubeconfig), context, configuration)
    elif not master:
        try:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError) as in_cluster:
            # not in a Pod (no KUBERNETES_SERVICE_HOST), or no service-account token mounted
            _load_kubeconfig(None, context, configuration, also=f"in-cluster: {in_cluster}")
    if master:
        # client-go's DefaultServerURL: a bare host:port means https
        configuration.host = (master if "://" in master else f"https://{master}").rstrip("/")
    configuration.retries = 0
    return Client(configuration, observe=observe)


# what the library raises on a document of the wrong shape (a list, a string, a bad base64 field)
_SHAPE = (TypeError, KeyError, AttributeError, ValueError)


def _load_kubeconfig(
    path: str | None, context: str | None, configuration: Any, *, also: str = ""
) -> None:
    """`load_kube_config`, its failures as one `ConfigError` line (`also`: what failed first)."""
    where = path or kube_config.KUBE_CONFIG_DEFAULT_LOCATION
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
