"""Delegated authentication and authorization of the secure metrics port, as kube-scheduler's
and kube-controller-manager's (k8s.io/apiserver's delegating authenticator and authorizer).

Owns `Delegation`: a request's bearer token is authenticated by a TokenReview
(authentication.k8s.io/v1) and the user it names authorized by a SubjectAccessReview
(authorization.k8s.io/v1, nonResourceAttributes: the path, verb `get`), both created on the
API server with the agent's own credentials (ClusterRole `system:auth-delegator`). The
answers:
- no bearer token, or a token the review does not authenticate: 401;
- an authenticated user the review does not allow: 403;
- the API unreachable, or answering other than 201 with a status: 503 (a scraper retries at
  its next interval; a 401 would say the token is bad, which nobody knows);
- otherwise None: the route answers.

Reviews are cached, keyed by the token's SHA-256 (no token is kept): an allowed answer for
`allowed_ttl` (10 s, the delegating authorizer's AllowCacheTTL and the authenticator's
CacheTTL), a refusal for `denied_ttl` (2 s: an RBAC grant shows quickly), an unreachable API
never; at most `max_entries` tokens (the oldest forgotten first), so a stream of made-up
tokens costs a bounded memory and one review each. `check` blocks on the API (seconds): it
is called in the HTTP server's worker thread (`serve.Protected`), never its event loop.

Imports: errors, the standard library (the API is reached through the `review` callable
that `kube.reviewer` makes).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ipvsproxy.errors import ApiUnavailable

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
ALLOWED_TTL = 10.0
DENIED_TTL = 2.0
MAX_ENTRIES = 1024

Review = Callable[[str, dict[str, Any]], dict[str, Any]]  # (path, object) -> created object
Refusal = tuple[int, str, bytes, Mapping[str, str]]

_TEXT = "text/plain; charset=utf-8"
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="ipvsproxy"'}
UNAUTHORIZED: Refusal = (401, _TEXT, b"Unauthorized\n", CHALLENGE)
UNAVAILABLE: Refusal = (503, _TEXT, b"cannot review the request with the API server\n", {})


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer T` header (the scheme case-insensitive, as the
    apiserver's bearertoken authenticator reads it), or None."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Delegation:
    """Checks requests to `path` by TokenReview and SubjectAccessReview (the module's doc)."""

    def __init__(
        self,
        review: Review,
        *,
        path: str = "/metrics",
        allowed_ttl: float = ALLOWED_TTL,
        denied_ttl: float = DENIED_TTL,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._review = review
        self.path = path
        self.allowed_ttl = allowed_ttl
        self.denied_ttl = denied_ttl
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[float, Refusal | None]] = OrderedDict()

    def check(self, authorization: str | None) -> Refusal | None:
        """The refusal of a request with this `Authorization` header, or None to answer it."""
        token = bearer(authorization)
        if token is None:
            return UNAUTHORIZED
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                self._cache.move_to_end(key)
                return cached[1]
        try:
            verdict = self._decide(token)
        except ApiUnavailable as exc:
            log.warning("secure metrics: cannot review a request: %s", exc)
            return UNAVAILABLE
        ttl = self.allowed_ttl if verdict is None else self.denied_ttl
        with self._lock:
            self._cache[key] = (now + ttl, verdict)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return verdict

    def _decide(self, token: str) -> Refusal | None:
        reviewed = self._review(TOKEN_REVIEWS, token_review(token))
        status = _status(reviewed)
        user = status.get("user")
        if status.get("authenticated") is not True or not isinstance(user, dict):
            return UNAUTHORIZED
        access = self._review(ACCESS_REVIEWS, access_review(user, self.path))
        if _status(access).get("allowed") is True:
            return None
        name = user.get("username", "")
        message = f'forbidden: User "{name}" cannot get path "{self.path}"\n'
        return 403, _TEXT, message.encode(), {}


def token_review(token: str) -> dict[str, Any]:
    """The TokenReview that asks who `token` is (no audiences: the API server's own)."""
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token},
    }


def access_review(user: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The SubjectAccessReview that asks whether `user` (a TokenReview's status.user) may GET
    the non-resource URL `path`, with its groups, uid and extra (as the delegating
    authorizer sends them)."""
    spec: dict[str, Any] = {
        "user": user.get("username", ""),
        "groups": list(user.get("groups") or []),
        "nonResourceAttributes": {"path": path, "verb": "get"},
    }
    if user.get("uid"):
        spec["uid"] = user["uid"]
    if user.get("extra"):
        spec["extra"] = user["extra"]
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": spec,
    }


def _status(created: Mapping[str, Any]) -> Mapping[str, Any]:
    status = created.get("status")
    if not isinstance(status, dict):
        raise ApiUnavailable(f"a {created.get('kind', 'review')} came back without a status")
    return status
