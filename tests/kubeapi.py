"""A small Kubernetes API server for tests: the real list/watch wire protocol over HTTPS.

Test code, not shipped. It serves Services, EndpointSlices (discovery.k8s.io/v1) and Nodes
the way kube-apiserver does (checked against ../shared/api-captures from v1.36.2):
- HTTPS with a throw-away CA (trustme); bearer-token auth, 401 + Status for a wrong token;
- lists: `XList` with `metadata.resourceVersion`, items without kind/apiVersion, `limit` and
  `continue` pagination (400 BadRequest for a bad token), `fieldSelector=metadata.name=`,
  namespaced collections, equality-based `labelSelector`;
- watches (`watch=1`) from a resourceVersion: the events after it, then live events, as
  chunked line-delimited JSON; `resourceVersion` unset or "0" starts with synthetic ADDED
  events; `allowWatchBookmarks` gives BOOKMARK events (also just before a timeout ends the
  stream); `timeoutSeconds` ends the stream cleanly; a resourceVersion older than the last
  compaction gets HTTP 200 with one ERROR event, Status 410 Expired;
- TokenReview (authentication.k8s.io/v1) and SubjectAccessReview (authorization.k8s.io/v1)
  creates, as kube-apiserver answers them: 201 Created, the request's object with `status`
  filled (`authenticated` + `user`, `allowed` + `reason`); `reviewed_tokens` maps a token to
  its user ({"username", "uid", "groups"}), `allowed_users` names who may GET a
  nonResourceURL (username -> set of paths); 400 for a body that is not the kind;
- test controls: `put()` (create or replace), `delete()`, `compact()`, `end_watches()`,
  `whole_lists` (an Event: cleared, the whole lists of Services and slices wait),
  `stop()` (connections dropped as by a crash) and `start()` again on the same port, plus a
  request log to assert on.

Reached through the real `kubernetes` client with the kubeconfig `write_kubeconfig()` makes.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import copy
import json
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import trustme

RESOURCES = {  # path -> (kind, apiVersion, namespaced)
    "/api/v1/services": ("Service", "v1", True),
    "/apis/discovery.k8s.io/v1/endpointslices": ("EndpointSlice", "discovery.k8s.io/v1", True),
    "/api/v1/nodes": ("Node", "v1", False),
}
WHOLE_LISTS = ("/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices")
BOOKMARK_BODY: dict[str, dict[str, Any]] = {  # the zero values kube-apiserver leaves in
    "Service": {"spec": {}, "status": {"loadBalancer": {}}},
    "EndpointSlice": {"addressType": "", "endpoints": None, "ports": None},
    "Node": {"spec": {}, "status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}}},
}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass(frozen=True)
class Event:
    version: int
    kind: str
    type: str
    obj: dict[str, Any]


def _bearer(header: str | None) -> str | None:
    """The token of an `Authorization` header as the apiserver reads it (its bearertoken
    authenticator: trimmed, split on spaces, the scheme compared case-insensitively, so the
    in-cluster loader's `bearer <token>` is accepted like `Bearer <token>`)."""
    parts = (header or "").strip().split(" ", 2)
    if len(parts) < 2 or parts[0].lower() != "bearer" or not parts[1]:
        return None
    return parts[1]


class ApiServer:
    def __init__(
        self,
        *,
        token: str = "test-token",
        bookmark_interval: float = 1.0,
        max_watch_seconds: float = 1800.0,
        host: str = "127.0.0.1",  # where it listens ("0.0.0.0": also behind a Service)
    ) -> None:
        self.host = host
        self.token = token
        # accepted beside `token`: a rotation's moment when the old and the new are both valid
        self.also_accepted: set[str | None] = set()
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self._ca = trustme.CA()
        self._cert = self._ca.issue_cert("127.0.0.1", "localhost")
        self._state = threading.Condition()
        self._version = 1000
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
            kind: {} for kind, _, _ in RESOURCES.values()
        }
        self._history: list[Event] = []  # in resourceVersion order
        self._versions: list[int] = []  # each event's version, for bisect
        # per kind, its keys sorted as "namespace/name" (None: to sort again after a put of a
        # new key or a delete): a page starts by bisection, not by sorting every object (a
        # list of 44,000 Services is 88 pages)
        self._sorted: dict[str, list[str] | None] = {
            kind: None for kind, _, _ in RESOURCES.values()
        }
        self._oldest = 0  # watches from a resourceVersion below this get 410
        self._generation = 0  # bumped by stop() and end_watches(): open streams end
        self._abort = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (path, token ok?, query)
        # cleared by a test: the whole lists of Services and EndpointSlices (every namespace,
        # no selector) wait until it is set again, as a large cluster's lists take a while
        self.whole_lists = threading.Event()
        self.whole_lists.set()
        # the reviews' answers (TokenReview, SubjectAccessReview), and their count by kind
        self.reviewed_tokens: dict[str, dict[str, Any]] = {}
        self.allowed_users: dict[str, set[str]] = {}
        self.reviews: dict[str, int] = {"TokenReview": 0, "SubjectAccessReview": 0}
        self._http: _Server | None = None
        self.port = 0

    def create(self, path: str, authorization: str | None, data: bytes) -> tuple[int, Any]:
        """A POST: 201 and the review answered, 401 for a wrong token, 404 for another path,
        400 for a body that is not the review's kind."""
        authorized = _bearer(authorization) == self.token
        self.requests.append((path, "ok" if authorized else "denied", {}))
        if not authorized:
            return 401, status(401, "Unauthorized", "Unauthorized")
        kind = REVIEWS.get(path)
        if kind is None:
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        try:
            body = json.loads(data or b"null")
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("kind") != kind:
            return 400, status(400, "BadRequest", f"the body is not a {kind}")
        self.reviews[kind] += 1
        return 201, self.review(kind, body)

    def review(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """The created review: the request's object with its `status`, as the API answers."""
        spec = body.get("spec") or {}
        answer = {**body, "metadata": {"creationTimestamp": None}}
        if kind == "TokenReview":
            user = self.reviewed_tokens.get(spec.get("token", ""))
            if user is None:
                answer["status"] = {"user": {}, "error": "[invalid bearer token]"}
            else:
                answer["status"] = {"authenticated": True, "user": user, "audiences": []}
            return answer
        attrs = spec.get("nonResourceAttributes") or {}
        paths = self.allowed_users.get(spec.get("user", ""), set())
        if attrs.get("verb") == "get" and attrs.get("path") in paths:
            answer["status"] = {"allowed": True, "reason": "RBAC: allowed by ClusterRoleBinding"}
        else:
            answer["status"] = {"allowed": False}
        return answer

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> ApiServer:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._cert.configure_cert(context)
        server = _Server((self.host, self.port), _handler(self))
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
        self.port = server.server_address[1]
        with self._state:
            self._abort = False
        self._http = server
        threading.Thread(target=server.serve_forever, name="kubeapi", daemon=True).start()
        return self

    def stop(self) -> None:
        """Go away as a crashed server does: listening socket closed, streams cut."""
        with self._state:
            self._abort = True
            self._generation += 1
            self._state.notify_all()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http.close_all()
            self._http = None

    def end_watches(self) -> None:
        """End every open watch stream cleanly, as the server's timeout does."""
        with self._state:
            self._generation += 1
            self._state.notify_all()

    def refused_for_good(self) -> list[tuple[str, dict[str, str]]]:
        """The requests refused and never asked again with a token accepted: a request in flight
        with the old token when a rotation ends is refused rightly; the client must then read
        the new one and retry (a list with the same query, or any watch of that path)."""
        left = []
        for i, (path, ok, query) in enumerate(self.requests):
            if ok == "ok":
                continue
            watch = query.get("watch") == "true"
            if not any(
                later_ok == "ok"
                and later_path == path
                and (later_query.get("watch") == "true" if watch else later_query == query)
                for later_path, later_ok, later_query in self.requests[i + 1 :]
            ):
                left.append((path, query))
        return left

    def watched(self) -> set[str]:
        """The collections a watch was asked for so far (whatever the token's answer)."""
        return {path for path, _, query in self.requests if query.get("watch") == "true"}

    @property
    def ca_pem(self) -> bytes:
        """The certificate of the CA that signed the server's, as a client is given it."""
        return self._ca.cert_pem.bytes()

    def write_kubeconfig(self, path: Path, *, token: str | None = None) -> Path:
        ca = base64.b64encode(self._ca.cert_pem.bytes()).decode()
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "test",
                            "cluster": {
                                "server": f"https://127.0.0.1:{self.port}",
                                "certificate-authority-data": ca,
                            },
                        }
                    ],
                    "users": [{"name": "test", "user": {"token": token or self.token}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                    "current-context": "test",
                }
            )
        )
        return path

    # ---- objects --------------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._state:
            return self._version

    def list_answer(
        self, path: str, kind: str, query: dict[str, str]
    ) -> tuple[int, dict[str, Any]]:
        """A list request's answer; the whole lists wait while `whole_lists` is cleared."""
        if path in WHOLE_LISTS:
            self.whole_lists.wait(timeout=600)
        return self.list_page(kind, query)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (ADDED or MODIFIED); returns it as stored."""
        kind = obj["kind"]
        stored = copy.deepcopy(obj)
        meta = stored.setdefault("metadata", {})
        key = (meta.get("namespace", "") if kind != "Node" else "", meta["name"])
        with self._state:
            old = self._objects[kind].get(key)
            self._version += 1
            meta["resourceVersion"] = str(self._version)
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault(
                "creationTimestamp",
                old["metadata"]["creationTimestamp"] if old else _now(),
            )
            self._objects[kind][key] = stored
            self._record(kind, "MODIFIED" if old else "ADDED", stored)
        return stored

    def delete(self, kind: str, namespace: str, name: str) -> None:
        with self._state:
            old = self._objects[kind].pop(("" if kind == "Node" else namespace, name))
            self._version += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._version)
            self._record(kind, "DELETED", gone)

    def compact(self) -> None:
        """Forget the event history: older resourceVersions become 410 Gone."""
        with self._state:
            self._history.clear()
            self._versions.clear()
            self._oldest = self._version + 1

    def _record(self, kind: str, kind_of_event: str, obj: dict[str, Any]) -> None:
        self._history.append(Event(self._version, kind, kind_of_event, obj))
        self._versions.append(self._version)
        if kind_of_event != "MODIFIED":  # a key came or went
            self._sorted[kind] = None
        self._state.notify_all()

    # ---- serving (called by the handler) --------------------------------------------

    def list_page(self, kind: str, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        limit = int(query.get("limit") or 0)
        after, version = "", None
        if query.get("continue"):
            try:
                token = json.loads(base64.b64decode(query["continue"], validate=True))
                after, version = str(token["start"]), int(token["rv"])
            except (ValueError, KeyError, TypeError):
                return 400, status(400, "BadRequest", "invalid continue token")
        with self._state:
            if version is not None and version < self._oldest:
                return 410, status(410, "Expired", "The provided continue parameter is too old")
            version = version or self._version
            keys = self._sorted[kind]
            if keys is None:
                keys = self._sorted[kind] = sorted("/".join(key) for key in self._objects[kind])
            objects = self._objects[kind]
            begin = bisect.bisect_right(keys, after)
            if query.get("fieldSelector") or query.get("labelSelector"):
                items = [o for k in keys[begin:] if _selected(o := objects[_key(k)], query)]
                page = items[:limit] if limit else items
                rest = len(items) - len(page)
            else:  # no selector: only the page's objects are looked at
                end = min(begin + limit, len(keys)) if limit else len(keys)
                page, rest = [objects[_key(k)] for k in keys[begin:end]], len(keys) - end
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        if rest:
            last = page[-1]["metadata"]
            start = f"{last.get('namespace', '')}/{last['name']}"
            token = json.dumps({"start": start, "rv": version}).encode()
            meta["continue"] = base64.b64encode(token).decode()
            meta["remainingItemCount"] = rest
        body_items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in page]
        api_version = next(v for k, v, _ in RESOURCES.values() if k == kind)
        return 200, {
            "kind": f"{kind}List",
            "apiVersion": api_version,
            "metadata": meta,
            "items": body_items,
        }

    def watch(self, kind: str, query: dict[str, str]) -> Iterator[dict[str, Any]]:
        """The events of one watch request, until its timeout, end_watches() or stop()."""
        timeout = min(float(query.get("timeoutSeconds") or 1e9), self.max_watch_seconds)
        requested = query.get("resourceVersion", "")
        with self._state:
            generation = self._generation
            if requested in ("", "0"):  # start with the current objects, as ADDED events
                since = self._version
                initial = [
                    {"type": "ADDED", "object": o}
                    for _, o in sorted(self._objects[kind].items())
                    if _selected(o, query)
                ]
            elif int(requested) < self._oldest - 1:
                message = f"too old resource version: {requested} ({self._version})"
                initial = [{"type": "ERROR", "object": status(410, "Expired", message)}]
                since = -1
            else:
                since, initial = int(requested), []
        yield from initial
        if since >= 0:
            bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
            deadline = time.monotonic() + timeout
            yield from self._follow(kind, query, since, generation, deadline, bookmarks)

    def _follow(
        self,
        kind: str,
        query: dict[str, str],
        sent: int,
        generation: int,
        deadline: float,
        bookmarks: bool,
    ) -> Iterator[dict[str, Any]]:
        last_send = time.monotonic()
        while True:
            with self._state:
                if self._generation == generation and not self._pending(sent):
                    wait = min(deadline, last_send + self.bookmark_interval) - time.monotonic()
                    self._state.wait(max(wait, 0))
                if self._generation != generation:
                    if self._abort:
                        raise ConnectionAbortedError("server stopped")
                    return
                pending, current = self._pending(sent), self._version
            for event in pending:
                sent = event.version
                if event.kind == kind and _selected(event.obj, query):
                    yield {"type": event.type, "object": event.obj}
                    last_send = time.monotonic()
            now = time.monotonic()
            if bookmarks and (now >= deadline or now - last_send >= self.bookmark_interval):
                sent = max(sent, current)
                yield _bookmark(kind, current)  # also just before the timeout ends the stream
                last_send = now
            if now >= deadline:
                return

    def _pending(self, sent: int) -> list[Event]:
        return self._history[bisect.bisect_right(self._versions, sent) :]


def _key(joined: str) -> tuple[str, str]:
    """("namespace", "name") from "namespace/name" (a Node's: "/name")."""
    namespace, _, name = joined.partition("/")
    return namespace, name


def _bookmark(kind: str, version: int) -> dict[str, Any]:
    api_version = next(v for k, v, _ in RESOURCES.values() if k == kind)
    obj = {
        "kind": kind,
        "apiVersion": api_version,
        "metadata": {"resourceVersion": str(version)},
        **copy.deepcopy(BOOKMARK_BODY[kind]),
    }
    return {"type": "BOOKMARK", "object": obj}


def _selected(obj: dict[str, Any], query: dict[str, str]) -> bool:
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        field, _, value = term.partition("=")
        value = value.removeprefix("=")
        if field == "metadata.name" and obj["metadata"].get("name") != value:
            return False
        if field == "metadata.namespace" and obj["metadata"].get("namespace") != value:
            return False
    labels = obj["metadata"].get("labels") or {}
    return all(_label_matches(labels, t) for t in query.get("labelSelector", "").split(",") if t)


def _label_matches(labels: dict[str, str], term: str) -> bool:
    """One equality-based requirement (k8s.io/apimachinery/pkg/labels): key=value,
    key==value, key!=value, key, !key."""
    if "!=" in term:
        key, _, value = term.partition("!=")
        return labels.get(key.strip()) != value.strip()
    if "=" in term:
        key, _, value = term.partition("=")
        return labels.get(key.strip()) == value.removeprefix("=").strip()
    if term.startswith("!"):
        return term[1:].strip() not in labels
    return term.strip() in labels


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or refuses the certificate (the tests of a bad CA do) is
        the client's business, as for a real API server: not a traceback in the test log."""
        if isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError):
            return
        super().handle_error(request, client_address)

    def close_all(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


class _Creates(BaseHTTPRequestHandler):
    """POSTs: the reviews' creates (`ApiServer.create`)."""

    api: ApiServer

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._json(*self.api.create(self.path, self.headers.get("Authorization"), data))

    def _json(self, code: int, body: dict[str, Any]) -> None:
        raise NotImplementedError


def _handler(api: ApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Creates):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            bearer = _bearer(self.headers.get("Authorization"))
            authorized = bearer == api.token or bearer in api.also_accepted
            api.requests.append((url.path, "ok" if authorized else "denied", query))
            resource = _resource(url.path, query)
            if not authorized:
                self._json(401, status(401, "Unauthorized", "Unauthorized"))
            elif resource is None:
                message = "the server could not find the requested resource"
                self._json(404, status(404, "NotFound", message))
            elif query.get("watch") in ("1", "true"):
                self._stream(api.watch(resource, query))
            else:
                self._json(*api.list_answer(url.path, resource, query))

        def _json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            # a client may stop reading (a body over its cap) and close: not the server's error
            with contextlib.suppress(OSError):
                self.wfile.write(data)

        def _stream(self, events: Iterator[dict[str, Any]]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for event in events:
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (ConnectionAbortedError, OSError):
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    Handler.api = api
    return Handler


REVIEWS = {
    "/apis/authentication.k8s.io/v1/tokenreviews": "TokenReview",
    "/apis/authorization.k8s.io/v1/subjectaccessreviews": "SubjectAccessReview",
}


def _resource(path: str, query: dict[str, str]) -> str | None:
    """The kind of a cluster-wide or namespaced collection path; a namespace becomes a
    field selector in `query`."""
    for base, (kind, _, namespaced) in RESOURCES.items():
        if path == base:
            return kind
        prefix, _, plural = base.rpartition("/")
        if namespaced and path.startswith(prefix + "/namespaces/"):
            rest = path[len(prefix) + len("/namespaces/") :].split("/")
            if len(rest) == 2 and rest[1] == plural:
                selector = query.get("fieldSelector")
                query["fieldSelector"] = ",".join(
                    filter(None, [selector, f"metadata.namespace={rest[0]}"])
                )
                return kind
    return None
