"""The secure metrics port: delegated authentication (TokenReview) and authorization
(SubjectAccessReview) against the test API server, over real HTTPS sockets on 127.0.0.1."""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipvsproxy import kube
from ipvsproxy.cli.settings import service_metrics_config
from ipvsproxy.delegation import Delegation, access_review, bearer
from ipvsproxy.errors import ApiUnavailable, ConfigError
from ipvsproxy.serve import HttpServer, Protected
from ipvsproxy.servingcert import self_signed, server_context
from tests.kubeapi import ApiServer

PROMETHEUS: dict[str, Any] = {
    "username": "system:serviceaccount:monitoring:prometheus",
    "uid": "7f0c",
    "groups": ["system:serviceaccounts", "system:authenticated"],
}
INTRUDER = {"username": "system:serviceaccount:default:default", "groups": []}


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServer]:
    server = ApiServer().start()
    server.reviewed_tokens = {"prom-token": PROMETHEUS, "other-token": INTRUDER}
    server.allowed_users = {PROMETHEUS["username"]: {"/metrics"}}
    yield server
    server.stop()


@pytest.fixture
def client(api: ApiServer, tmp_path: Path) -> Iterator[Any]:
    connected = kube.connect(kubeconfig=api.write_kubeconfig(tmp_path / "kc"), context=None)
    yield connected
    connected.close()


def code(check: Any, authorization: str | None) -> int:
    """The status `check` answers a request with (200: it answers the route)."""
    refusal = check(authorization)
    return 200 if refusal is None else refusal[0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_token_is_reviewed_then_its_user_and_each_refusal_has_its_code(api, client):
    check = Delegation(kube.reviewer(client)).check
    assert code(check, None) == 401
    assert code(check, "Basic dXNlcjpwYXNz") == 401
    assert code(check, "Bearer made-up") == 401  # not authenticated
    refusal = check("Bearer other-token")
    assert refusal is not None
    assert refusal[0] == 403
    assert b"system:serviceaccount:default:default" in refusal[2]
    assert check("Bearer prom-token") is None
    assert check("bearer  prom-token ") is None  # the scheme case-insensitive, as the apiserver


def test_the_access_review_asks_for_get_on_the_path_with_the_users_groups():
    review = access_review(PROMETHEUS, "/metrics")
    assert review["kind"] == "SubjectAccessReview"
    assert review["apiVersion"] == "authorization.k8s.io/v1"
    assert review["spec"] == {
        "user": PROMETHEUS["username"],
        "uid": "7f0c",
        "groups": PROMETHEUS["groups"],
        "nonResourceAttributes": {"path": "/metrics", "verb": "get"},
    }
    assert bearer("Bearer ") is None


def test_answers_are_cached_allowed_longer_than_denied(api, client):
    clock = Clock()
    check = Delegation(kube.reviewer(client), clock=clock).check
    before = dict(api.reviews)

    def reviews() -> int:
        return int(api.reviews["TokenReview"] - before["TokenReview"])

    assert check("Bearer prom-token") is None
    assert code(check, "Bearer other-token") == 403
    assert reviews() == 2
    clock.now += 1.9
    assert check("Bearer prom-token") is None
    assert code(check, "Bearer other-token") == 403
    assert reviews() == 2, "both answers come from the cache"
    clock.now += 0.2  # 2.1 s: the refusal (2 s) has expired, the allowance (10 s) not
    assert code(check, "Bearer other-token") == 403
    assert check("Bearer prom-token") is None
    assert reviews() == 3
    clock.now += 8.0  # 10.1 s since the allowance
    assert check("Bearer prom-token") is None
    assert reviews() == 4


def test_the_cache_holds_at_most_max_entries_tokens_the_least_recently_used_dropped(api, client):
    check = Delegation(kube.reviewer(client), clock=Clock(), max_entries=2).check
    before = api.reviews["TokenReview"]
    code(check, "Bearer prom-token")
    code(check, "Bearer other-token")
    code(check, "Bearer prom-token")  # used again: other-token is now the oldest
    code(check, "Bearer made-up")  # a third token: other-token is dropped
    assert api.reviews["TokenReview"] - before == 3
    assert code(check, "Bearer made-up") == 401
    assert code(check, "Bearer prom-token") == 200
    assert api.reviews["TokenReview"] - before == 3, "the two most recently used are cached"
    assert code(check, "Bearer other-token") == 403
    assert api.reviews["TokenReview"] - before == 4, "the least recently used was reviewed again"


def test_an_api_that_cannot_be_reached_gives_503_and_nothing_is_cached(tmp_path):
    down = ApiServer()
    down.port = 1  # nothing listens there
    connected = kube.connect(kubeconfig=down.write_kubeconfig(tmp_path / "kc"), context=None)
    try:
        review = kube.reviewer(connected, seconds=2.0)
        with pytest.raises(ApiUnavailable, match="POST /apis/authentication.k8s.io"):
            review("/apis/authentication.k8s.io/v1/tokenreviews", {"kind": "TokenReview"})
        delegation = Delegation(review)
        assert code(delegation.check, "Bearer prom-token") == 503
        assert delegation._cache == {}
    finally:
        connected.close()


def test_a_review_the_api_refuses_to_create_is_503_not_an_answer(api, tmp_path):
    wrong = kube.connect(kubeconfig=api.write_kubeconfig(tmp_path / "kc", token="x"), context=None)
    try:
        assert code(Delegation(kube.reviewer(wrong)).check, "Bearer prom-token") == 503
    finally:
        wrong.close()


# ---- over HTTPS -------------------------------------------------------------------------


def _get(port: int, token: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the port's certificate is self-signed
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", "/metrics", headers=headers)
        response = conn.getresponse()
        return response.status, response.read(), dict(response.getheaders())
    finally:
        conn.close()


def _metrics() -> tuple[int, str, bytes]:
    return 200, "text/plain", b"ipvsproxy_build_info 1\n"


@pytest.fixture
def secure(client) -> Iterator[HttpServer]:
    check = Delegation(kube.reviewer(client)).check
    tls = server_context(None, None)
    server = HttpServer(("127.0.0.1", 0), {"/metrics": Protected(_metrics, check)}, tls=tls)
    server.start()
    yield server
    server.close()


def test_an_unauthenticated_client_is_refused_401(secure):
    status, body, headers = _get(secure.port)
    assert status == 401
    assert b"build_info" not in body
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert _get(secure.port, "made-up")[0] == 401


def test_an_authenticated_but_unauthorized_client_gets_403(secure):
    status, body, _ = _get(secure.port, "other-token")
    assert status == 403
    assert b"build_info" not in body


def test_an_authorized_client_reads_the_metrics(secure):
    status, body, _ = _get(secure.port, "prom-token")
    assert (status, body) == (200, b"ipvsproxy_build_info 1\n")


def test_plain_http_to_the_secure_port_gets_no_metrics(secure):
    conn = http.client.HTTPConnection("127.0.0.1", secure.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        with pytest.raises((http.client.HTTPException, OSError)):
            conn.getresponse().read()
    finally:
        conn.close()


def test_a_review_in_progress_never_holds_the_health_port():
    """The review runs in the worker thread: the event loop answers other ports meanwhile."""
    entered, release = threading.Event(), threading.Event()

    def slow(path: str, body: dict[str, Any]) -> dict[str, Any]:
        entered.set()
        release.wait(30)
        return {"status": {"authenticated": False, "user": {}}}

    tls = server_context(None, None)
    secure = HttpServer(
        ("127.0.0.1", 0), {"/metrics": Protected(_metrics, Delegation(slow).check)}, tls=tls
    ).start()
    health = HttpServer(("127.0.0.1", 0), {"/healthz": lambda: (200, "text/plain", b"ok\n")})
    health.start()
    try:
        result: list[int] = []
        scrape = threading.Thread(target=lambda: result.append(_get(secure.port, "t")[0]))
        scrape.start()
        assert entered.wait(10), "the review has started"
        conn = http.client.HTTPConnection("127.0.0.1", health.port, timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
        release.set()
        scrape.join(10)
        assert result == [401]
    finally:
        release.set()
        health.close()
        secure.close()


# ---- configuration ----------------------------------------------------------------------


def _opts(**given: Any) -> dict[str, Any]:
    opts = {
        "service_metrics": False, "endpoint_metrics": False, "service_metrics_max_series": 10,
        "status_remote": False, "secure_metrics_bind_address": "", "tls_cert_file": None,
        "tls_private_key_file": None,
    }  # fmt: skip
    return {**opts, **given}


def test_the_secure_port_options_are_checked_in_one_line_each(tmp_path):
    config = service_metrics_config(_opts(secure_metrics_bind_address="0.0.0.0:10263"))
    assert config["secure_metrics_bind_address"] == ("0.0.0.0", 10263)
    assert service_metrics_config(_opts())["secure_metrics_bind_address"] is None
    with pytest.raises(ConfigError, match="--secure-metrics-bind-address: 'localhost:x'"):
        service_metrics_config(_opts(secure_metrics_bind_address="localhost:x"))
    with pytest.raises(ConfigError, match="need --secure-metrics-bind-address"):
        service_metrics_config(_opts(tls_cert_file=tmp_path / "c"))
    with pytest.raises(ConfigError, match="go together"):
        service_metrics_config(
            _opts(secure_metrics_bind_address="0.0.0.0:1", tls_cert_file=tmp_path / "c")
        )


def test_a_certificate_that_cannot_be_loaded_is_one_line(tmp_path):
    cert, key = self_signed(["node-a"])
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    assert server_context(tmp_path / "tls.crt", tmp_path / "tls.key")
    (tmp_path / "bad.crt").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="cannot load --tls-cert-file") as caught:
        server_context(tmp_path / "bad.crt", tmp_path / "tls.key")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="No such file"):
        server_context(tmp_path / "missing.crt", tmp_path / "tls.key")


# ---- the agent's wiring -----------------------------------------------------------------


def test_the_agents_secure_port_refuses_without_a_token_and_serves_the_agents_metrics(
    api, tmp_path
):
    from ipvsproxy.agent import Cluster, Manifests, _serve_secure_metrics
    from ipvsproxy.config import Config
    from ipvsproxy.metrics import Metrics
    from tests.support import free_port

    port = free_port()
    config = Config(node_name="node-a", secure_metrics_bind_address=("127.0.0.1", port))
    source = Cluster(api.write_kubeconfig(tmp_path / "kc"))
    close = _serve_secure_metrics(config, source, Metrics())
    try:
        assert _get(port)[0] == 401
        assert _get(port, "other-token")[0] == 403
        status, body, _ = _get(port, "prom-token")
        assert status == 200
        assert b"ipvsproxy_build_info{" in body
    finally:
        close()
    with pytest.raises(ConfigError, match="not with --manifests"):
        _serve_secure_metrics(config, Manifests((tmp_path / "m.yaml",)), Metrics())
