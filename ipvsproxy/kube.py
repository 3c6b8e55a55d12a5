"""The Kubernetes API source: list, then watch, Services, EndpointSlices and this node's Node.

Owns: `connect()` (kubeconfig / in-cluster / default location → an API client, from
`ipvsproxy.kubeclient`), `reviewer()` (the secure metrics port's TokenReview and
SubjectAccessReview creates, for `ipvsproxy.delegation`) and `Watcher` (one resource's
list-then-watch loop feeding a `Tracker`). With `ipvsproxy.kubeclient` the only user of the
`kubernetes` client: its objects never leave these two modules; the tracker gets raw JSON
dicts.

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

Every response is bounded in size and time, so a broken or hostile server costs a retry, never
the agent's memory or a hung `diff` (docs/reliability.md, "Hostile and unlucky nodes"):
- a list page is read up to `max_page_bytes` (64 MiB: a page holds 500 objects, ~1 KB each for
  a Service of kube-apiserver v1.36, so ~0.5 MB; 500 EndpointSlices of 100 endpoints ~15 MB),
  and one whole list (every page) up to `max_list_bytes` (512 MiB: 50,000 Services are ~55 MB,
  their EndpointSlices for 150,000 Pods, Kubernetes' tested maximum, ~100 MB); a page over
  its cap is asked for again with half the `limit`, down to one object (`Unlistable` beyond:
  an error, retried with backoff);
- one watch event line is read up to `max_event_bytes` (16 MiB: etcd refuses an object over
  1.5 MiB, and its JSON is at most a few times that);
- a list waits `read_timeout` (60 s: kube-apiserver ends a non-watch request after its
  --request-timeout, 1 minute by default) between bytes and `list_deadline` (300 s) for all its
  pages: a server trickling a byte at a time is cut there (`kubeclient.Deadline`), and so is
  a lookup of its name that never ends; a watch stream is cut `inactivity_timeout` after the
  `timeoutSeconds` the server was asked to end it;
- a reply that is not a list of the kind asked for (`[1,2,3]`, `{"metadata": "x"}`, no
  `metadata.resourceVersion`) is refused: never read as an empty list, which would delete
  every Service.
A refused response is a `Transient` error: `run` retries it with backoff and logs why; `diff`
(`list_once`) turns it into one `ApiUnavailable` line, exit status 2.

Why the client's `watch.Watch` is not used: it builds client model objects for every event
(we need the raw JSON, and the models cost), and it answers a 410 by silently retrying once
from the same resourceVersion. The client still does configuration, authentication, TLS and
the HTTP requests; this module reads the line-delimited JSON of the stream itself.

Imports: kubeclient (the kubernetes client), tenacity, urllib3, api, sync.tracker, following,
errors.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import re
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tenacity
import urllib3

from ipvsproxy.api import SERVICE_NAME_LABEL, Read, read
from ipvsproxy.backoff import Backoff
from ipvsproxy.errors import ApiUnavailable, WatchError
from ipvsproxy.following import Following
from ipvsproxy.kubeclient import ApiException, Deadline, Observe, client, unobserved
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE

log = logging.getLogger(__name__)

PAGE = 500  # items per list page, as client-go's reflector
# the smallest page asked for when pages are over `max_page_bytes`: an object etcd stores is
# at most 1.5 MiB, so only a hostile or broken server has a page of one object over the cap
MIN_PAGE = 1
CHUNK = 64 * 1024  # bytes asked of the socket per read
MiB = 1024 * 1024


def connect(
    *,
    kubeconfig: Path | None,
    context: str | None,
    master: str | None = None,
    origin: str = "--kubeconfig",
    observe: Observe = unobserved,
) -> Any:
    """An API client: `kubeconfig` if given, else in-cluster, else the default kubeconfig;
    `master` overrides the server; `origin` names where `kubeconfig` came from in errors;
    `observe` is told of every request (the rest_client_* metrics).

    The caller closes it (`.close()`); see `ipvsproxy.kubeclient.client`.
    """
    return client(
        kubeconfig=kubeconfig, context=context, master=master, origin=origin, observe=observe
    )


@dataclass(frozen=True, slots=True)
class Settings:
    watch_timeout: float = 300.0  # asked of the server; jittered by up to +50% per stream
    inactivity_timeout: float = 120.0  # nothing read from a watch for this long: reconnect
    connect_timeout: float = 10.0
    read_timeout: float = 60.0  # nothing read from a list for this long: give up
    list_deadline: float = 300.0  # one whole list, every page of it
    max_page_bytes: int = 64 * MiB  # one list response
    max_list_bytes: int = 512 * MiB  # every page of one list
    max_event_bytes: int = 16 * MiB  # one watch event (one line)
    backoff: Backoff = Backoff(first=0.5, cap=30.0)


class Gone(Exception):
    """410: the resourceVersion is too old; relist."""


class Transient(Exception):
    """Worth retrying: connection loss, timeouts, 5xx, 429, an unreadable event."""


class TooLarge(Transient):
    """A response over its size cap (`_read_body`)."""


class Unlistable(Transient):
    """A page of `MIN_PAGE` objects is still over `max_page_bytes`: the list cannot complete
    (retried with backoff all the same, logged as an error each time: the object may shrink
    or go)."""


# The generated CoreV1Api and DiscoveryV1Api classes are not used: importing CoreV1Api alone costs
# seconds of every agent start (hundreds of validated methods, schemas built on first call;
# bench/startup.py times a start), for two GET paths, and they build model objects ipvsproxy never
# reads. The requests are the ones those methods make (kubeclient.Client: the generated client's
# HTTP layer with the Configuration's authentication, as ApiClient's param_serialize/call_api send
# them).
_PATHS = {
    SERVICE: "/api/v1/services",
    SLICE: "/apis/discovery.k8s.io/v1/endpointslices",
    NODE: "/api/v1/nodes",
}
_QUERY = {
    "limit": "limit",
    "_continue": "continue",
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
    "watch": "watch",
    "resource_version": "resourceVersion",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "timeout_seconds": "timeoutSeconds",
}


MAX_ERROR_BYTES = 64 * 1024  # of an error's body (a Status object: a few hundred bytes)


def _lister(
    api: Any, kind: str, node_name: str, scope: tuple[str, dict[str, str]] | None = None
) -> Callable[..., Any]:
    """GET one collection (list or watch): the undecoded urllib3 response, or ApiException.
    `scope`: (namespace, selectors) of a smaller collection, for `first_lists`."""
    fixed = {"field_selector": f"metadata.name={node_name}"} if kind == NODE else {}
    path = _PATHS[kind]
    if scope is not None:
        namespace, fixed = scope
        if namespace:  # /api/v1/namespaces/NS/services
            root, _, plural = path.rpartition("/")
            path = f"{root}/namespaces/{urllib.parse.quote(namespace, safe='')}/{plural}"

    def get(*, _request_timeout: Any = None, **params: Any) -> Any:
        query = [(_QUERY[k], v) for k, v in {**fixed, **params}.items() if v is not None]
        response = api.get(path, query, timeout=_request_timeout)
        if not 200 <= response.status <= 299:
            try:
                data = _read_body(response.response, MAX_ERROR_BYTES, cut=True)
            finally:
                response.response.close()
                response.response.release_conn()
            body = data.decode("utf-8", "replace")
            raise ApiException.from_response(http_resp=response, body=body, data=None)
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
        scope: tuple[str, dict[str, str]] | None = None,
        following: Following | None = None,
    ) -> None:
        self.kind = kind
        # the API server's URL, named by the errors (a test's fake client may have none)
        self.server = getattr(getattr(api, "configuration", None), "host", "") or "the API server"
        self._list = _lister(api, kind, node_name, scope)
        self._scoped = scope is not None
        self._sink = sink
        self._stop = stop
        self._settings = settings
        self._on_restart = on_restart
        # told of every read and every failed step (whether this node still follows the API)
        self._following = following
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
        level = logging.ERROR if isinstance(error, Unlistable) else logging.WARNING
        log.log(
            level, "watch %s from %s: %s; retrying in %.1fs", self.kind, self.server, error, wait
        )
        self._on_restart(self.kind, "error")
        self._was_read(error=str(error))

    def _was_read(self, *, error: str | None = None) -> None:
        """Tell `following` of a read of this resource, or of a failed attempt (`error`)."""
        if self._following is None:
            return
        if error is None:
            self._following.read(self.kind)
        else:
            self._following.failed(self.kind, error)

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
        """List every object (page by page) into the sink; the list's resourceVersion.

        Bounded: `list_deadline` for every page together, `max_page_bytes` per page and
        `max_list_bytes` for all of them; past a bound, or on a reply that is not a list
        of the kind, a `Transient` error saying which. A page over `max_page_bytes` is asked
        for again with half the `limit` (see `_pages`); one of `MIN_PAGE` objects over it is
        `Unlistable`.
        """
        s = self._settings
        with Deadline(s.list_deadline) as deadline:
            try:
                items, version, limit = self._pages(s)
            except Transient as exc:
                if deadline.expired:
                    what = f"no complete answer within {s.list_deadline:g}s"
                    raise Transient(_at_deadline(what, exc)) from exc
                raise
        self._sink.replace(self.kind, items)
        self.listed = True
        self._was_read()
        smaller = (
            ""
            if limit == PAGE
            else f" in pages of {limit} (over {_size(s.max_page_bytes)} at {PAGE})"
        )
        level = logging.DEBUG if self._scoped else logging.INFO  # scoped: a few objects
        log.log(level, "listed %d %ss at resourceVersion %s%s", len(items), self.kind, version,
                smaller)  # fmt: skip
        return version

    def _pages(self, s: Settings) -> tuple[list[Read], str, int]:
        """Every item of one list, its resourceVersion, and the page size it ended with.

        A page over `max_page_bytes` is asked for again, from the same continue token (the
        token holds the list's resourceVersion and where the next page starts, not its size:
        a smaller page of the same list), with half the `limit`, down to `MIN_PAGE`; the rest
        of the list keeps the smaller size (objects that large come together: EndpointSlices
        of 1,000 endpoints), the next list starts at `PAGE` again. At most 9 (log2(PAGE) + 1)
        requests per page, each read to the cap at most; then `Unlistable`.
        """
        items: list[Read] = []
        token: str | None = None
        total, limit = 0, PAGE  # bytes of every page so far; objects asked for per page
        while True:
            try:
                data = self._page(
                    s, limit, token, cap=min(s.max_page_bytes, s.max_list_bytes - total)
                )
            except Gone as exc:
                if not token:  # a list from no resourceVersion cannot be too old
                    raise Transient("410 Gone without a continue token") from exc
                items, token, total = [], None, 0  # the continue token expired: start over
                continue
            except TooLarge as exc:
                if s.max_list_bytes - total < s.max_page_bytes:
                    raise  # the whole list is over its cap: smaller pages add up the same
                limit = self._smaller(limit, exc, s)
                continue
            total += len(data)
            raw, token, version = _list_page(self.kind, data)
            # parsed page by page: a large list never holds every raw object at once
            items += [read(self.kind, item) for item in raw]
            if not token:
                return items, version, limit

    def _page(self, s: Settings, limit: int, token: str | None, *, cap: int) -> bytearray:
        """The body of one list page (`token`: the continue token of the page before)."""
        kwargs: dict[str, Any] = {"limit": limit}
        if token:
            kwargs["_continue"] = token
        page = self._request(read_timeout=s.read_timeout, **kwargs)
        try:
            return _read_body(page, cap)
        except BaseException:
            page.close()  # the rest of the body is not wanted: not back to the pool
            raise
        finally:
            page.release_conn()

    def _smaller(self, limit: int, exc: TooLarge, s: Settings) -> int:
        """The page size to ask for after a page of `limit` objects was over the cap."""
        cap = _size(s.max_page_bytes)
        if limit <= MIN_PAGE:
            raise Unlistable(
                f"a page of {limit} {self.kind} is over the {cap} page cap, so the list "
                f"cannot complete ({exc})"
            ) from exc
        smaller = max(limit // 2, MIN_PAGE)
        log.debug("list %ss: a page of %d over %s (%s); asking for %d",
                  self.kind, limit, cap, exc, smaller)  # fmt: skip
        return smaller

    def _stream(self) -> None:
        """One watch request from self._version, which each event and bookmark advances."""
        s = self._settings
        timeout = int(s.watch_timeout * (1 + random.random() / 2))
        # the server ends the stream at `timeout`; one that goes on is cut (a trickle of
        # bytes that never completes an event would pass every read timeout)
        limit = timeout + s.inactivity_timeout
        cut = f"stream still open {limit:g}s after it was asked to end at {timeout}s; cut"
        with Deadline(limit) as deadline:
            try:
                self._follow(timeout, s)
            except Transient as exc:
                if deadline.expired:
                    raise Transient(_at_deadline(cut, exc)) from exc
                raise
            if deadline.expired:  # cut where the stream could end cleanly: still a failure
                raise Transient(cut)

    def _follow(self, timeout: int, s: Settings) -> None:
        response = self._request(
            read_timeout=s.inactivity_timeout,
            watch=True,
            resource_version=self._version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
        )
        self._was_read()  # the stream is open: a quiet one reads nothing until a change
        try:
            for event in _events(response, s.max_event_bytes):
                self._version = self._handle(event, self._version or "")
                self._was_read()
                if self._stop.is_set():
                    break
        finally:
            response.close()  # a watch connection is not reused: its stream may be cut short
            response.release_conn()

    def _handle(self, event: dict[str, Any], version: str) -> str:
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, dict):
            raise Transient(f"event without an object: {event!r:.200}")
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message", "")
            if code == 410:
                raise Gone(message)
            raise Transient(f"error event {code!r:.20}: {message!r:.300}")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._sink.event(self.kind, kind, obj)  # a malformed object: a warning there
        elif kind != "BOOKMARK":
            log.warning("watch %s: ignoring event type %.100r", self.kind, kind)
        meta = obj.get("metadata")
        resumed = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return resumed if isinstance(resumed, str) and resumed else version

    def _request(self, *, read_timeout: float, **kwargs: Any) -> Any:
        s = self._settings
        try:
            return self._list(_request_timeout=(s.connect_timeout, read_timeout), **kwargs)
        except ApiException as exc:
            raise self._api_error(exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Transient(_why(exc)) from exc

    def _api_error(self, exc: ApiException) -> Exception:
        status, reason = exc.status, _status_message(exc)
        if status == 410:
            return Gone(reason)
        if status in (401, 403, 404) and not self.listed:
            hint = {401: "is the token right?", 403: "does the service account have RBAC "
                    "get/list/watch on services, endpointslices and nodes?",
                    404: "does the server serve discovery.k8s.io/v1?"}[status]  # fmt: skip
            return WatchError(
                f"cannot list {self.kind}s from {self.server}: {status} {reason} ({hint})"
            )
        return Transient(f"{status} {reason}")


DIFF = Settings()  # what `list_once` uses unless told (tests shorten it)


def list_once(
    api: Any, kinds: Sequence[str], *, node_name: str, sink: Any, settings: Settings | None = None
) -> None:
    """One complete list of each of `kinds` into `sink` (`diff`): any failure to reach or
    understand the API server is one `ApiUnavailable` line naming it; a refusal for good
    (401, 403, 404) stays a `WatchError`."""
    for kind in kinds:
        _list_or_raise(api, kind, node_name, sink, settings or DIFF)


def _list_or_raise(
    api: Any,
    kind: str,
    node_name: str,
    sink: Any,
    settings: Settings,
    scope: tuple[str, dict[str, str]] | None = None,
) -> None:
    """One complete list (of `scope` only, if given) into `sink`; a failure to reach or
    understand the API server is one `ApiUnavailable` line naming it."""
    watcher = Watcher(
        kind, api=api, node_name=node_name, sink=sink, stop=threading.Event(),
        settings=settings, scope=scope,
    )  # fmt: skip
    try:
        watcher.list_all()
    except (Transient, Gone) as exc:
        raise ApiUnavailable(
            f"cannot read {kind}s from {watcher.server}: {_one_line(exc)}"
        ) from exc


def first_lists(
    api: Any,
    refs: Sequence[tuple[str, str]],
    *,
    node_name: str,
    sink: Any,
    settings: Settings | None = None,
) -> None:
    """The Services `refs` (namespace, name), their EndpointSlices and this node's Node,
    listed alone (by field and label selector: a few small requests) into `sink`, one
    complete list per kind: a node's first pass can serve them before the whole lists of a
    large cluster have arrived (agent_loop's `early`). Raises as `list_once` does."""
    settings = settings or DIFF
    scopes: dict[str, list[tuple[str, dict[str, str]] | None]] = {
        SERVICE: [(ns, {"field_selector": f"metadata.name={name}"}) for ns, name in refs],
        SLICE: [(ns, {"label_selector": f"{SERVICE_NAME_LABEL}={name}"}) for ns, name in refs],
        NODE: [None],
    }
    found: dict[str, list[Read]] = {}

    class Collect:
        def replace(self, kind: str, items: list[Read]) -> None:
            found.setdefault(kind, []).extend(items)

    for kind, kind_scopes in scopes.items():
        for scope in kind_scopes:
            _list_or_raise(api, kind, node_name, Collect(), settings, scope)
    for kind in scopes:
        sink.replace(kind, found.get(kind, []))


def _read_body(response: Any, cap: int, *, cut: bool = False) -> bytearray:
    """The body of `response`, at most `cap` bytes (`cut`: its first `cap` bytes; else a
    longer one is a `Transient` error)."""
    length = response.headers.get("Content-Length", "")
    if not cut and length.isdigit() and int(length) > cap:
        raise TooLarge(f"response of {_size(int(length))}, over {_size(cap)}")
    data = bytearray()
    try:
        while chunk := response.read1(CHUNK):
            data += chunk
            if len(data) > cap:
                if cut:
                    return data[:cap]
                raise TooLarge(f"response over {_size(cap)}; gave up reading it")
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise Transient(_why(exc)) from exc
    return data


def _list_page(kind: str, data: bytes | bytearray) -> tuple[list[Any], str | None, str]:
    """The raw items, the continue token and the resourceVersion of one list page; a
    `Transient` error for anything that is not a page of a `kind` list."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise Transient(f"unreadable response: {_one_line(exc)}") from exc
    what = f"not a {kind}List"
    if not isinstance(body, dict):
        text = bytes(data[:100]).decode("utf-8", "replace")
        raise Transient(f"{what} (a JSON {type(body).__name__}: {text!r})")
    if "items" not in body:
        raise Transient(f"{what} (no items)")
    items, meta = body["items"], body.get("metadata")
    if items is None:  # an empty list, as Go writes a nil slice
        items = []
    if not isinstance(items, list):
        raise Transient(f"{what} (items: {type(items).__name__}, not a list)")
    if not isinstance(meta, dict):
        raise Transient(f"{what} (metadata: {type(meta).__name__}, not an object)")
    version, token = meta.get("resourceVersion"), meta.get("continue")
    if not isinstance(version, str) or not version:
        raise Transient(f"{what} (no metadata.resourceVersion)")
    if token is not None and not isinstance(token, str):
        raise Transient(f"{what} (metadata.continue: {type(token).__name__}, not a string)")
    return items, token, version


def _events(response: Any, cap: int) -> Iterator[dict[str, Any]]:
    """The events of a watch stream, one JSON object a line, each at most `cap` bytes."""
    for line in _lines(response, cap):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise Transient(f"unreadable event: {_one_line(exc)}: {line[:200]!r}") from exc
        if not isinstance(event, dict):
            raise Transient(f"unreadable event: {line[:200]!r}")
        yield event


def _lines(response: Any, cap: int) -> Iterator[bytes]:
    """The newline-ended lines of `response`'s body (a last one without a newline, cut by
    the end of the stream, is dropped); a line over `cap` bytes is a `Transient` error."""
    buffer = bytearray()
    try:
        while chunk := response.read1(CHUNK):
            searched = len(buffer)  # no newline before here
            buffer += chunk
            start = 0
            while (end := buffer.find(b"\n", max(start, searched))) >= 0:
                yield bytes(buffer[start:end])
                start = end + 1
            del buffer[:start]
            if len(buffer) > cap:
                raise Transient(f"an event over {_size(cap)} without its newline")
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise Transient(_why(exc)) from exc


def _at_deadline(what: str, exc: Transient) -> str:
    """Why a request was cut at its deadline: `what`, unless no connection was made by then
    (its name still resolving, or the connect under way): then `exc` says so."""
    cause = exc.__cause__
    if isinstance(cause, urllib3.exceptions.MaxRetryError):
        cause = cause.reason
    return str(exc) if isinstance(cause, urllib3.exceptions.ConnectTimeoutError) else what


def _size(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:g} MiB"
    return f"{n / 1024:g} KiB" if n >= 1024 else f"{n} bytes"


def _why(exc: BaseException) -> str:
    """A urllib3/socket error in one line, without the pool's repr."""
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    if isinstance(exc, urllib3.exceptions.ProtocolError) and len(exc.args) == 2:
        what, cause = exc.args  # ("Connection aborted.", ConnectionResetError(...))
        if isinstance(cause, http.client.BadStatusLine):
            return f"not an HTTP reply: {_one_line(cause)[:100]!r}"
        if isinstance(cause, BaseException):
            return f"{str(what).rstrip('.').lower()}: {_why(cause)}"
    if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) and exc.strerror:
        return exc.strerror
    if type(exc) is urllib3.exceptions.ConnectTimeoutError and len(exc.args) == 2:
        return _printable(str(exc.args[1]))  # (connection, message), as urllib3 raises it
    text = _one_line(exc)
    text = re.sub(r"^\w+\(host='[^']*', port=\d+\): ", "", text)
    text = re.sub(r"^<[^>]*>: ", "", text)
    if isinstance(exc, (urllib3.exceptions.SSLError, ssl.SSLError)):
        return f"TLS: {text}"
    return text or type(exc).__name__


def _one_line(exc: BaseException) -> str:
    return _printable(str(exc))


def _printable(text: str) -> str:
    """`text` in one line of at most 500 characters, control characters escaped (a server's
    words go into log lines and `diff`'s error line)."""
    text = " ".join(text.split())[:500]
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _status_message(exc: ApiException) -> str:
    """The Status object's message if the body is one, else the HTTP reason (one line)."""
    try:
        status = json.loads(exc.body or "")
        message = str(status.get("message") or exc.reason)
    except (ValueError, AttributeError, RecursionError):
        message = str(exc.reason)
    return _printable(message)


REVIEW_SECONDS = 5.0  # one TokenReview or SubjectAccessReview, all in (a scrape times out at 10)
MAX_REVIEW_BYTES = 64 * 1024  # a review's answer: a few hundred bytes


def reviewer(api: Any, *, seconds: float = REVIEW_SECONDS) -> Callable[[str, dict[str, Any]], Any]:
    """What creates a review on the API server (`delegation.Delegation`'s `review`): POST the
    object, the created object back (201); anything else (no connection, a timeout, another
    status, a body that is not a JSON object or over MAX_REVIEW_BYTES) is one
    `ApiUnavailable` line. Bounded by `seconds` in all (`Deadline`), whatever the server
    does."""

    def review(path: str, body: dict[str, Any]) -> Any:
        try:
            with Deadline(seconds):
                response = api.post(path, body, timeout=(seconds, seconds))
                try:
                    data = _read_body(response.response, MAX_REVIEW_BYTES)
                finally:
                    response.response.close()
                    response.response.release_conn()
        except Exception as exc:  # urllib3's, ssl's, the socket's, a body over its cap
            raise ApiUnavailable(f"POST {path}: {_one_line(exc)}") from exc
        if response.status != 201:
            raise ApiUnavailable(f"POST {path}: HTTP {response.status}")
        try:
            created = json.loads(data)
        except ValueError as exc:
            raise ApiUnavailable(f"POST {path}: not JSON") from exc
        if not isinstance(created, dict):
            raise ApiUnavailable(f"POST {path}: not an object")
        return created

    return review
