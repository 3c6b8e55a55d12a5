"""The Kubernetes API source: list, then watch, Services, EndpointSlices and this node's Node.

Owns: `connect()` (kubeconfig / in-cluster / default location → an API client, from
`ipvsproxy.kubeclient`) and `Watcher` (one resource's list-then-watch loop feeding a
`Tracker`). With `ipvsproxy.kubeclient` the only user of the `kubernetes` client: its objects
never leave these two modules; the tracker gets raw JSON dicts.

The watch loop is three small layers (after kopf's watching.py):
- `Watcher.run()` never returns until stopped: it runs `step()` after `step()`, retrying a
  failed one with exponential backoff and full jitter (tenacity) on connection loss, 5xx,
  429 and inactivity; it gives up only on an error that retrying cannot fix before anything
  was ever listed (a wrong token, a forbidden resource): a `WatchError`.
- `step()` lists (paginated; the list replaces the tracker's view of the resource) when there
  is no resourceVersion to resume from, else runs one watch stream from it; `410 Gone` (the
  version expired) clears it, so the next step relists. A dropped connection resumes from
  the newest version seen (events and bookmarks advance it), without a list.
- `_stream()` is one watch request: the server ends it at `timeoutSeconds`; the socket's read
  timeout is the per-stream inactivity timeout (bookmarks keep a quiet stream alive).

Why the client's `watch.Watch` is not used: it builds client model objects for every event
(we need the raw JSON, and the models cost), and it answers a 410 by silently retrying once
from the same resourceVersion. The client still does configuration, authentication, TLS and
the HTTP requests; this module reads the line-delimited JSON of the stream itself.

Imports: kubeclient (the kubernetes client), tenacity, urllib3, api, sync.tracker, errors.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tenacity
import urllib3

from ipvsproxy.api import Read, read
from ipvsproxy.backoff import Backoff
from ipvsproxy.errors import WatchError
from ipvsproxy.kubeclient import ApiException, Observe, client, iter_resp_lines, unobserved
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE

log = logging.getLogger(__name__)

PAGE = 500  # items per list page, as client-go's reflector


def connect(
    *,
    kubeconfig: Path | None,
    context: str | None,
    master: str | None = None,
    observe: Observe = unobserved,
) -> Any:
    """An API client: `kubeconfig` if given, else in-cluster, else the default kubeconfig;
    `master` overrides the server; `observe` is told of every request (the rest_client_*
    metrics).

    The caller closes it (`.close()`); see `ipvsproxy.kubeclient.client`.
    """
    return client(kubeconfig=kubeconfig, context=context, master=master, observe=observe)


@dataclass(frozen=True, slots=True)
class Settings:
    watch_timeout: float = 300.0  # asked of the server; jittered by up to +50% per stream
    inactivity_timeout: float = 120.0  # nothing read for this long: reconnect
    connect_timeout: float = 10.0
    backoff: Backoff = Backoff(first=0.5, cap=30.0)


class Gone(Exception):
    """410: the resourceVersion is too old; relist."""


class Transient(Exception):
    """Worth retrying: connection loss, timeouts, 5xx, 429, an unreadable event."""


# The generated CoreV1Api and DiscoveryV1Api classes are not used: importing CoreV1Api alone
# costs 1.8 s natively (413 pydantic-validated methods, schemas built on first call) on every
# agent start, for two GET paths, and they build model objects ipvsproxy never reads. The requests
# are the ones those methods make (kubeclient.Client: the generated client's HTTP layer with
# the Configuration's authentication, as ApiClient's param_serialize/call_api send them).
_PATHS = {
    SERVICE: "/api/v1/services",
    SLICE: "/apis/discovery.k8s.io/v1/endpointslices",
    NODE: "/api/v1/nodes",
}
_QUERY = {
    "limit": "limit",
    "_continue": "continue",
    "field_selector": "fieldSelector",
    "watch": "watch",
    "resource_version": "resourceVersion",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "timeout_seconds": "timeoutSeconds",
}


def _lister(api: Any, kind: str, node_name: str) -> Callable[..., Any]:
    """GET one collection (list or watch): the undecoded urllib3 response, or ApiException."""
    fixed = {"field_selector": f"metadata.name={node_name}"} if kind == NODE else {}

    def get(*, _request_timeout: Any = None, **params: Any) -> Any:
        query = [(_QUERY[k], v) for k, v in {**fixed, **params}.items() if v is not None]
        response = api.get(_PATHS[kind], query, timeout=_request_timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response

    return get


class Watcher:
    """List-then-watch one resource into `sink` (a Tracker) until `stop` is set."""

    def __init__(
        self,
        kind: str,
        *,
        api: Any,
        node_name: str,
        sink: Any,
        stop: threading.Event,
        settings: Settings = Settings(),
        on_restart: Callable[[str, str], None] = lambda kind, reason: None,
    ) -> None:
        self.kind = kind
        self._list = _lister(api, kind, node_name)
        self._sink = sink
        self._stop = stop
        self._settings = settings
        self._on_restart = on_restart
        self.listed = False
        self._version: str | None = None  # resume watching from here; None: list first

    def run(self) -> None:
        """Until stopped: step after step, with backoff after a failed one."""
        s = self._settings
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(Transient),
            wait=lambda state: s.backoff.jittered(state.attempt_number),
            stop=lambda _: self._stop.is_set(),
            sleep=self._sleep,
            before_sleep=self._log_retry,
            reraise=True,
        )
        while not self._stop.is_set():
            try:
                retrying(self.step)  # a new call per step: a step that worked resets the backoff
            except Transient:
                return  # stopped while backing off

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)  # a stop ends the backoff at once

    def _log_retry(self, state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0
        log.warning("watch %s: %s; retrying in %.1fs", self.kind, error, wait)
        self._on_restart(self.kind, "error")

    def step(self) -> None:
        """List if there is no resourceVersion to resume from, else one watch stream.

        A dropped connection is not a reason to relist: as client-go's reflector does, the
        next step resumes the watch from the newest version seen. Only 410 Gone forgets it.
        """
        if self._version is None:
            self._version = self.list_all()
            return
        try:
            self._stream()
        except Gone as exc:
            self._version = None
            log.info("watch %s: %s; relisting", self.kind, exc)
            self._on_restart(self.kind, "gone")

    def list_all(self) -> str:
        """List every object (page by page) into the sink; the list's resourceVersion."""
        items: list[Read] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": PAGE}
            if token:
                kwargs["_continue"] = token
            try:
                page = self._request(**kwargs)
                try:
                    body = json.loads(page.data)
                finally:
                    page.release_conn()
            except Gone:  # the continue token expired mid-list: start over
                items, token = [], None
                continue
            except ValueError as exc:
                raise Transient(f"list {self.kind}: unreadable response: {exc}") from exc
            # parsed page by page: a large list never holds every raw object at once
            items += [read(self.kind, item) for item in body.get("items") or []]
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        self._sink.replace(self.kind, items)
        self.listed = True
        version = str(meta.get("resourceVersion") or "")
        log.info("listed %d %ss at resourceVersion %s", len(items), self.kind, version)
        return version

    def _stream(self) -> None:
        """One watch request from self._version, which each event and bookmark advances."""
        s = self._settings
        timeout = int(s.watch_timeout * (1 + random.random() / 2))
        response = self._request(
            watch=True,
            resource_version=self._version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
        )
        try:
            for event in _events(response):
                self._version = self._handle(event, self._version or "")
                if self._stop.is_set():
                    break
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Transient(f"watch {self.kind}: {exc}") from exc
        finally:
            response.close()  # a watch connection is not reused: its stream may be cut short
            response.release_conn()

    def _handle(self, event: dict[str, Any], version: str) -> str:
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, dict):
            raise Transient(f"watch {self.kind}: event without an object: {event!r:.200}")
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message", "")
            if code == 410:
                raise Gone(message)
            raise Transient(f"watch {self.kind}: error event {code}: {message}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._sink.event(self.kind, kind, obj)
        elif kind != "BOOKMARK":
            log.warning("watch %s: ignoring event type %r", self.kind, kind)
        return str(meta.get("resourceVersion") or version)

    def _request(self, **kwargs: Any) -> Any:
        s = self._settings
        try:
            return self._list(
                _request_timeout=(s.connect_timeout, s.inactivity_timeout),
                **kwargs,
            )
        except ApiException as exc:
            raise self._api_error(exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Transient(f"{self.kind}: {exc}") from exc

    def _api_error(self, exc: ApiException) -> Exception:
        status, reason = exc.status, _status_message(exc)
        if status == 410:
            return Gone(reason)
        if status in (401, 403, 404) and not self.listed:
            hint = {401: "is the token right?", 403: "does the service account have RBAC "
                    "get/list/watch on services, endpointslices and nodes?",
                    404: "does the server serve discovery.k8s.io/v1?"}[status]  # fmt: skip
            return WatchError(f"cannot list {self.kind}s: {status} {reason} ({hint})")
        return Transient(f"{self.kind}: {status} {reason}")


def _events(response: Any) -> Iterator[dict[str, Any]]:
    for line in iter_resp_lines(response):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise Transient(f"unreadable watch event: {exc}: {line[:200]!r}") from exc
        if not isinstance(event, dict):
            raise Transient(f"unreadable watch event: {line[:200]!r}")
        yield event


def _status_message(exc: ApiException) -> str:
    """The Status object's message if the body is one, else the HTTP reason."""
    try:
        status = json.loads(exc.body or "")
        return str(status.get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)
