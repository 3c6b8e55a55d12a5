"""Health-check node ports (healthcheck.py), node eligibility in /healthz, the counters:
real HTTP on 127.0.0.1, a fake clock where time matters."""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from ipaddress import ip_address
from typing import Any

import pytest

from ipvsproxy.api import read
from ipvsproxy.config import Config
from ipvsproxy.healthcheck import ServiceHealth
from ipvsproxy.metrics import Metrics
from ipvsproxy.proxier import Proxier
from ipvsproxy.serve import Health, HttpServer
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, parse_node, parse_service, port, service, slice_
from tests.support import eventually, free_port, sample
from tests.test_serve import HOLD, SLOW_CLIENTS, Tricklers, answered

LOCAL = ["127.0.0.1"]


def get(port_: int, path: str = "/") -> tuple[int, dict[str, str], dict[str, Any]]:
    try:
        answer = urllib.request.urlopen(f"http://127.0.0.1:{port_}{path}", timeout=5)
    except urllib.error.HTTPError as err:
        answer = err
    return answer.status, dict(answer.headers), json.loads(answer.read())


def refused(port_: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port_), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture
def checks():
    healthy = [True]
    errors: list[int] = []
    server = ServiceHealth(healthy=lambda: healthy[0], on_bind_error=lambda: errors.append(1))
    yield server, healthy, errors
    server.close()


def test_200_with_the_local_count_503_without_or_when_the_proxy_is_unhealthy(checks):
    server, healthy, _ = checks
    web, db = free_port(), free_port()
    server.sync({"default/web": (web, 2), "prod/db": (db, 0)}, [ip_address("127.0.0.1")])
    status, headers, body = get(web, "/any/path")
    assert status == 200
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert body == {
        "service": {"namespace": "default", "name": "web"},
        "localEndpoints": 2,
        "serviceProxyHealthy": True,
    }
    status, headers, body = get(db)
    assert (status, headers["X-Load-Balancing-Endpoint-Weight"]) == (503, "0")
    assert body["service"] == {"namespace": "prod", "name": "db"}
    healthy[0] = False
    status, _, body = get(web)
    assert (status, body["localEndpoints"], body["serviceProxyHealthy"]) == (503, 2, False)


def test_counts_follow_a_port_moves_and_closes_with_its_service(checks):
    server, _, _ = checks
    first, moved = free_port(), free_port()
    at = [ip_address("127.0.0.1")]
    server.sync({"default/web": (first, 1)}, at)
    server.sync({"default/web": (first, 0)}, at)
    assert get(first)[0] == 503
    server.sync({"default/web": (moved, 3)}, at)
    assert refused(first)
    assert get(moved)[2]["localEndpoints"] == 3
    server.sync({}, at)
    assert refused(moved)
    assert server.ports == {}


def test_a_port_that_cannot_be_bound_is_logged_once_counted_and_retried(checks, caplog):
    server, _, errors = checks
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ok = free_port()
    at = [ip_address("127.0.0.1")]
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            server.sync({"default/web": (busy, 1), "default/ok": (ok, 1)}, at)
    assert get(ok)[0] == 200  # the other Service is served all the same
    assert len(errors) == 3
    assert sum("default/web" in r.message for r in caplog.records) == 1
    taken.close()
    server.sync({"default/web": (busy, 1), "default/ok": (ok, 1)}, at)
    assert get(busy)[0] == 200
    assert len(errors) == 3


def test_every_address_when_unrestricted(checks):
    server, _, _ = checks
    free = free_port()
    server.sync({"default/web": (free, 1)})
    assert get(free)[0] == 200  # "::" is dual-stack: 127.0.0.1 reaches it


def test_node_ports_are_answered_while_slow_clients_trickle_on_one_thread():
    """Twenty Services' node ports on the process's one HTTP thread; 200 clients trickle
    their requests into two of them and may hold them HOLD seconds: every probe on those
    ports and a third one is answered while none of the slow clients has been cut."""
    server = ServiceHealth(
        healthy=lambda: True, server=functools.partial(HttpServer, request_timeout=HOLD)
    )
    before = threading.active_count()
    ports = [free_port() for _ in range(20)]
    server.sync({f"default/s{i}": (p, 1) for i, p in enumerate(ports)}, [ip_address("127.0.0.1")])
    assert threading.active_count() == before + 1
    half = SLOW_CLIENTS // 2
    try:
        with Tricklers(ports[0], half) as one, Tricklers(ports[1], half) as two:
            time.sleep(0.5)
            assert all(answered(ports[i % 3], "/") for i in range(60))
            assert one.cut == two.cut == 0
        server.sync({}, [ip_address("127.0.0.1")])
        eventually(lambda: threading.active_count() == before, 30, "the HTTP thread ends")
    finally:
        server.close()


# ---- what the proxier hands over ---------------------------------------------------------


def lb(
    name: str = "web", *, policy: str = "Local", hc: int | None = 32001, ports: Any = None
) -> Any:
    spec: dict[str, Any] = {"externalTrafficPolicy": policy}
    if hc is not None:
        spec["healthCheckNodePort"] = hc
    return service(name, type="LoadBalancer", ports=ports or [port(node_port=30080)], **spec)


def fed(*objects: Any) -> Proxier:
    tracker = Tracker(node_name="node-a")
    for kind in (SERVICE, SLICE):
        tracker.replace(kind, [o for o in objects if o["kind"] == kind])
    proxier = Proxier(kernel=FakeKernel(), config=Config(node_name="node-a"))
    proxier.feed(tracker.take())
    return proxier


def test_health_checks_count_local_ready_endpoints_per_port():
    eps = [
        ep("10.244.0.1"),
        ep("10.244.0.2", ready=False, serving=True, terminating=True),  # terminating: no
        ep("10.244.0.3", node="node-b"),  # elsewhere: no
        ep("10.244.0.4", ready=False),
    ]
    two = [port("http", 80, node_port=30080), port("https", 443, node_port=30443)]
    proxier = fed(
        lb(ports=two),
        slice_(ports=(("http", 8080, "TCP"), ("https", 8443, "TCP")), endpoints=eps),
        lb("cluster", policy="Cluster"),
        lb("unset", hc=None),
    )
    assert proxier.health_checks == {"default/web": (32001, 2)}  # 1 endpoint x 2 ports


def test_an_endpoint_listed_twice_counts_once_in_one_slice_or_two():
    """kube-proxy keys endpoints by address: a hand-made slice listing one twice (or two
    slices listing it) gives one local ready endpoint, in any order of ready and not."""
    layouts = {
        "one slice": [slice_(endpoints=[ep("10.244.0.1"), ep("10.244.0.1")])],
        "one slice, not ready first": [
            slice_(endpoints=[ep("10.244.0.1", ready=False), ep("10.244.0.1")])
        ],
        "two slices": [
            slice_(name="web-1", endpoints=[ep("10.244.0.1")]),
            slice_(name="web-2", endpoints=[ep("10.244.0.1")]),
        ],
    }
    for layout, slices in layouts.items():
        assert fed(lb(), *slices).health_checks == {"default/web": (32001, 1)}, layout


def test_a_service_gone_or_changed_leaves_the_health_checks():
    tracker = Tracker(node_name="node-a")
    tracker.replace(SERVICE, [lb()])
    tracker.replace(SLICE, [slice_(endpoints=[ep("10.244.0.1")])])
    proxier = Proxier(kernel=FakeKernel(), config=Config(node_name="node-a"))
    proxier.feed(tracker.take())
    assert proxier.health_checks == {"default/web": (32001, 1)}
    tracker.event(SERVICE, "MODIFIED", lb(policy="Cluster"))
    proxier.feed(tracker.take())
    assert proxier.health_checks == {}
    tracker.event(SERVICE, "MODIFIED", lb(hc=32002))
    proxier.feed(tracker.take())
    assert proxier.health_checks == {"default/web": (32002, 1)}
    tracker.event(SERVICE, "DELETED", lb(hc=32002))
    proxier.feed(tracker.take())
    assert proxier.health_checks == {}


def test_health_check_node_port_is_parsed_where_kube_proxy_serves_it():
    assert parse_service(lb()).health_check_node_port == 32001
    assert parse_service(lb(policy="Cluster")).health_check_node_port == 0
    cluster_ip = service("web", healthCheckNodePort=32001, externalTrafficPolicy="Local")
    assert parse_service(cluster_ip).health_check_node_port == 0
    warning = read("Service", lb(hc=70000)).warning
    assert "Service default/web: spec.healthCheckNodePort 70000" in warning


# ---- /healthz: node eligibility, /livez, counters -----------------------------------------


def test_node_eligibility_is_kube_proxys():
    assert parse_node(node()).eligible
    deleting = node()
    deleting["metadata"]["deletionTimestamp"] = "2026-11-23T10:00:00Z"
    assert not parse_node(deleting).eligible
    tainted = node()
    taint = {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}
    tainted["spec"] = {"taints": [taint]}
    assert not parse_node(tainted).eligible
    other = node()
    other["spec"] = {"taints": [{"key": "node.kubernetes.io/unschedulable"}]}
    assert parse_node(other).eligible


def test_healthz_needs_an_eligible_node_livez_only_the_timing_and_both_are_counted():
    metrics = Metrics()
    now = [1000.0]
    health = Health(timeout=60, clock=lambda: now[0], on_answer=metrics.health_answered)
    assert health.healthz()[0] == 200
    health.node_eligible(False)
    code, _, body, headers = health.healthz()
    reply = json.loads(body)
    assert (code, reply["nodeEligible"], reply["healthy"]) == (503, False, False)
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert health.livez()[0] == 200
    assert health.healthy()  # what the health-check node ports report
    health.queued()
    now[0] += 61
    assert health.livez()[0] == 503
    assert not health.healthy()
    assert sample(metrics, "kubeproxy_proxy_healthz_total", code="200") == 1
    assert sample(metrics, "kubeproxy_proxy_healthz_total", code="503") == 1
    assert sample(metrics, "kubeproxy_proxy_livez_total", code="200") == 1
    assert sample(metrics, "kubeproxy_proxy_livez_total", code="503") == 1


def test_pending_changes_are_the_trackers_until_a_sync_takes_them():
    metrics = Metrics()
    tracker = Tracker(node_name="node-a")
    metrics.pending(tracker.pending)
    tracker.replace(SERVICE, [service("web")])
    tracker.replace(SLICE, [])
    tracker.event(SLICE, "ADDED", slice_())
    tracker.event(SLICE, "MODIFIED", slice_(endpoints=[ep("10.244.0.9")]))
    tracker.replace(NODE, [])
    assert sample(metrics, "kubeproxy_sync_proxy_rules_service_changes_pending") == 1
    # the slice's two changes (an empty list is none, as kube-proxy counts)
    assert sample(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 2
    tracker.take()
    assert sample(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0
