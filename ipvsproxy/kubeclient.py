"""The API client: configured as the `kubernetes` library does, importing only what it uses.

Owns `client()` (kubeconfig / in-cluster / default location → a `Client` that GETs from the
API server) and re-exports the two other library pieces `ipvsproxy.kube` needs
(`ApiException`, `iter_resp_lines`). Why not simply `load_kube_config` and `ApiClient`:

- Importing any part of `kubernetes` runs its package `__init__`, which imports every part of
  the client: the websocket stream, the dynamic client, the informer, leader election, and
  `kubernetes.config`, whose `kube_config` imports oauthlib, requests_oauthlib, requests and
  dateutil at the top (for OIDC and GCP tokens); `ApiClient` imports pydantic, dateutil and
  every model class, for (de)serialising models ipvsproxy never builds (it reads raw JSON).
  Natively that is 0.3 s; in the IPVS test VM (every instruction emulated), where issue 13
  times the agent from process start to a complete table, it was 9.6 s of a 25 s start
  (`python -X importtime`).
- So the `kubernetes`, `kubernetes.config` and `kubernetes.utils` package `__init__`s are
  deferred
  (`_defer_package_inits`): each package module exists with its `__path__`, its submodules
  import as usual, and its `__init__` runs in full the first time anybody reads an attribute
  of it, so other code in the process (`from kubernetes import config;
  config.load_kube_config(...)`) still gets what it expects.
- `Client` sends its GETs through the generated client's own HTTP layer (`RESTClientObject`:
  TLS, client certificates, proxy, keepalive, the connection pool, all from the
  `Configuration`) with the headers `ApiClient.param_serialize` would add (authorization
  from `Configuration.auth_settings()`, which also refreshes in-cluster tokens).
- A kubeconfig file whose user authenticates with a token, a token file, a client
  certificate or a user name and password (kubeadm's, kops', a ServiceAccount token: what a
  node agent is given) is read here (`_read_simple`), field for field as the library's
  `KubeConfigLoader` reads it (tests compare the two on the same files; the one deliberate
  difference: a token file's surrounding whitespace is stripped, as kubectl/client-go do).
  Anything else (exec plugins, auth providers, a malformed file, several files in
  `$KUBECONFIG`, no `--kubeconfig`) goes to the library, unchanged, errors included.

Imports: kubernetes (client.configuration, client.rest, client.exceptions,
config.incluster_config, config.config_exception, watch.watch), urllib3, yaml, errors.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import contextlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import urllib3
import yaml

from ipvsproxy.errors import ConfigError


def _defer_package_inits() -> None:
    """The package modules `kubernetes`, `kubernetes.config` and `kubernetes.utils`, each
    running its `__init__` on the first read of a name it does not hold yet (once: a second
    thread asking meanwhile waits for it, then reads the name)."""
    lock = threading.RLock()  # one __init__ may read a name of another deferred package
    for name in ("kubernetes", "kubernetes.config", "kubernetes.utils"):
        if name in sys.modules:
            continue  # already imported (a test process, say): nothing to save
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return  # not the package layout this expects: the normal import applies
        module = importlib.util.module_from_spec(spec)
        # PEP 562: called only for names not defined; kept until the __init__ has run, so
        # another thread asking meanwhile waits for it on the lock
        module.__dict__["__getattr__"] = _init_on_first_miss(module, spec.loader, lock)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def _init_on_first_miss(module: Any, loader: Any, lock: threading.RLock) -> Any:
    names = module.__dict__

    def init_then_read(attribute: str) -> Any:
        with lock:
            if names.get("__getattr__") is init_then_read and not names.get("__running__"):
                names["__running__"] = True  # its own reads meanwhile: plain misses
                try:
                    loader.exec_module(module)
                finally:
                    del names["__running__"]
                    if names.get("__getattr__") is init_then_read:  # not the __init__'s own
                        del names["__getattr__"]
        if attribute in names:
            return names[attribute]
        raise AttributeError(f"module {module.__name__!r} has no attribute {attribute!r}")

    return init_then_read


_defer_package_inits()

from kubernetes.client import __version__ as LIBRARY_VERSION  # noqa: E402
from kubernetes.client.configuration import Configuration  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from kubernetes.client.rest import RESTClientObject  # noqa: E402
from kubernetes.config.config_exception import ConfigException  # noqa: E402
from kubernetes.config.incluster_config import load_incluster_config  # noqa: E402
from kubernetes.watch.watch import iter_resp_lines  # noqa: E402

__all__ = ["ApiException", "Client", "client", "iter_resp_lines"]


class Client:
    """GETs from the API server, as the generated API classes send them."""

    def __init__(self, configuration: Any) -> None:
        self.configuration = configuration
        self._rest = RESTClientObject(configuration)
        self._user_agent = f"ipvsproxy (kubernetes-client-python {LIBRARY_VERSION})"

    def get(self, path: str, query: list[tuple[str, Any]], *, timeout: Any = None) -> Any:
        """The `RESTResponse` (status, undecoded body) of GET `path?query`."""
        pairs = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in query]
        url = self.configuration.host + path
        if pairs:
            url += "?" + urlencode(pairs, quote_via=quote, safe="/")
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        for auth in self.configuration.auth_settings().values():
            if auth["in"] == "header" and auth["value"]:
                headers[auth["key"]] = auth["value"]
        return self._rest.request(  # type: ignore[no-untyped-call]
            "GET", url, headers=headers, _request_timeout=timeout
        )

    def close(self) -> None:
        self._rest.pool_manager.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def client(*, kubeconfig: Path | None, context: str | None) -> Client:
    """A `Client`: `kubeconfig` if given, else in-cluster, else the default kubeconfig.

    The caller closes it (`.close()`). urllib3's own retries are off: the watch loop retries
    with backoff itself, and a hidden retry would only delay seeing a failure.
    """
    configuration = Configuration()
    try:
        if kubeconfig is not None:
            if not kubeconfig.is_file():
                raise ConfigError(f"--kubeconfig {kubeconfig}: no such file")
            if not _read_simple(kubeconfig, context, configuration):
                _library_load(str(kubeconfig), context, configuration)
        else:
            try:
                load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except ConfigException:
                _library_load(None, context, configuration)
    except (ConfigException, OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
        where = kubeconfig or "in-cluster config, or the default kubeconfig ~/.kube/config"
        raise ConfigError(
            f"cannot load the Kubernetes client configuration ({where}): {exc}"
        ) from exc
    configuration.retries = 0
    return Client(configuration)


def _library_load(path: str | None, context: str | None, configuration: Any) -> None:
    from kubernetes.config.kube_config import load_kube_config  # the full import, on demand

    load_kube_config(  # type: ignore[no-untyped-call]
        config_file=path, context=context, client_configuration=configuration
    )


# ---- the simple kubeconfig ------------------------------------------------------------------


class _NotSimple(Exception):
    """Leave this file to the library (which also words any error in it)."""


def _read_simple(path: Path, context: str | None, configuration: Any) -> bool:
    """Configure from `path` as `KubeConfigLoader.load_and_set`; False: not a simple file."""
    if os.pathsep in str(path):
        return False  # the library reads that as several files to merge
    try:
        doc = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        settings = _settings(doc, context, Path(os.path.abspath(os.path.dirname(path))))
    except (_NotSimple, OSError, UnicodeDecodeError, yaml.YAMLError, binascii.Error):
        return False
    if "token" in settings:
        configuration.api_key["BearerToken"] = settings.pop("token")
    for key, value in settings.items():
        setattr(configuration, key, value)
    return True


def _settings(doc: Any, context: str | None, base: Path) -> dict[str, Any]:
    """The `Configuration` attributes the library would set, or `_NotSimple`."""
    if not isinstance(doc, dict):
        raise _NotSimple
    chosen = _named(doc, "contexts", context if context is not None else doc.get("current-context"))
    user_name = _field(chosen, "user", str, None)
    user: dict[str, Any] = {}
    if user_name and doc.get("users"):
        user = _named(doc, "users", user_name, missing_ok=True)
    cluster = _named(doc, "clusters", _field(chosen, "cluster", str))
    if "auth-provider" in user or "exec" in user:
        raise _NotSimple  # token sources that need code: the library's
    out: dict[str, Any] = {}
    if token := _token(user, base):
        out["token"] = f"Bearer {token}"
    elif "username" in user and "password" in user:
        pair = f"{_field(user, 'username', str)}:{_field(user, 'password', str)}"
        out["token"] = urllib3.util.make_headers(basic_auth=pair)["authorization"]
    host = _field(cluster, "server", str).rstrip("/")
    out["host"] = host
    if host.startswith("https"):
        out["ssl_ca_cert"] = _as_file(cluster, "certificate-authority", base)
        out["cert_file"] = _as_file(user, "client-certificate", base)
        out["key_file"] = _as_file(user, "client-key", base)
    if "insecure-skip-tls-verify" in cluster:
        out["verify_ssl"] = not _field(cluster, "insecure-skip-tls-verify", bool)
    for key, attribute in (("tls-server-name", "tls_server_name"), ("proxy-url", "proxy")):
        if key in cluster:
            out[attribute] = _field(cluster, key, str)
    return out


def _named(doc: dict[str, Any], section: str, name: Any, *, missing_ok: bool = False) -> Any:
    """The inner mapping of the first entry called `name` in the list `section`."""
    entries = doc.get(section)
    if not isinstance(entries, list) or not isinstance(name, str) or not name:
        raise _NotSimple
    inner = section.rstrip("s")  # contexts -> context, users -> user, clusters -> cluster
    for entry in entries:
        if not isinstance(entry, dict) or "name" not in entry:
            raise _NotSimple
        if entry["name"] == name:
            value = entry.get(inner)
            if not isinstance(value, dict):
                raise _NotSimple
            return value
    if missing_ok:
        return {}
    raise _NotSimple


def _field(obj: dict[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    value = obj.get(key, default)
    if value is ... or (value is not default and not isinstance(value, kind)):
        raise _NotSimple
    return value


def _token(user: dict[str, Any], base: Path) -> str:
    """`token`, else the content of `tokenFile` (the library: the key present wins)."""
    if "token" in user:
        return str(_field(user, "token", str))
    if "tokenFile" in user:
        return (base / str(_field(user, "tokenFile", str))).read_text().strip()
    return ""


def _as_file(obj: dict[str, Any], key: str, base: Path) -> str | None:
    """A path to `key`'s content: `key-data` (base64) written to a private file, else `key`."""
    if f"{key}-data" in obj:
        data = _field(obj, f"{key}-data", str)
        return _private_file(base64.b64decode(data, validate=True)) if data else None
    if key in obj:
        file = os.path.normpath(base / str(_field(obj, key, str)))
        if not os.path.isfile(file):
            raise _NotSimple  # the library says "File does not exist: ..."
        return file
    return None


def _private_file(data: bytes) -> str:
    """A file readable by this user only, removed when the process exits."""
    fd, name = tempfile.mkstemp(prefix="ipvsproxy-kubeconfig-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    atexit.register(_remove, name)
    return name


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)
