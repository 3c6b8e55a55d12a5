"""Table-driven translation tests: raw API objects -> the exact desired IPVS state."""

from __future__ import annotations

from typing import Any

import pytest

from ipvsproxy.model import (
    IpvsState,
)
from ipvsproxy.schedulers import Scheduler
from tests.factories import (
    BOTH,
    LOCAL,
    WEB_SLICE,
    R,
    S,
    V,
    ep,
    node,
    port,
    service,
    slice_,
    translate,
)

CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any], IpvsState]] = {
    "clusterip": ([service(), WEB_SLICE], {}, S({V("10.96.0.10"): BOTH}, "10.96.0.10")),
    "dual-stack clusterIPs, endpoints of each family": (
        [
            service(cluster_ips=("10.96.0.10", "fd00::10")),
            WEB_SLICE,
            slice_(name="web-v6", family="IPv6", endpoints=[ep("fd00:244::1")]),
        ],
        {},
        S(
            {V("10.96.0.10"): BOTH, V("fd00::10"): [R("fd00:244::1")]},
            "10.96.0.10",
            "fd00::10",
        ),
    ),
    "externalIPs are bound virtual servers": (
        [service(externalIPs=["198.51.100.7"]), WEB_SLICE],
        {},
        S({V("10.96.0.10"): BOTH, V("198.51.100.7"): BOTH}, "10.96.0.10", "198.51.100.7"),
    ),
    "loadbalancer ingress IPs, not ipMode Proxy, plus node ports": (
        [
            service(
                type="LoadBalancer",
                ports=[port(node_port=31000)],
                status={
                    "loadBalancer": {
                        "ingress": [
                            {"ip": "203.0.113.1"},
                            {"ip": "203.0.113.2", "ipMode": "Proxy"},
                            {"hostname": "lb.example.com"},
                        ]
                    }
                },
            ),
            WEB_SLICE,
            node(),
        ],
        {},
        S(
            {V("10.96.0.10"): BOTH, V("203.0.113.1"): BOTH, V("192.168.0.10", 31000): BOTH},
            "10.96.0.10",
            "203.0.113.1",
        ),
    ),
    "ingress IPs of a non-LoadBalancer Service are ignored": (
        [service(status={"loadBalancer": {"ingress": [{"ip": "203.0.113.1"}]}}), WEB_SLICE],
        {},
        S({V("10.96.0.10"): BOTH}, "10.96.0.10"),
    ),
    "nodeport on every node address of the Service's family, not bound": (
        [
            service(type="NodePort", ports=[port(node_port=30080)]),
            WEB_SLICE,
            node(addresses=("192.168.0.10", "10.0.0.10", "fd00:1::10")),
        ],
        {},
        S(
            {
                V("10.96.0.10"): BOTH,
                V("192.168.0.10", 30080): BOTH,
                V("10.0.0.10", 30080): BOTH,
                # no V("fd00:1::10", 30080): an IPv4-only Service gets nothing in IPv6
            },
            "10.96.0.10",
        ),
    ),
    "nodeport-addresses selects node addresses": (
        [
            service(type="NodePort", ports=[port(node_port=30080)]),
            WEB_SLICE,
            node(addresses=("192.168.0.10", "10.0.0.10")),
        ],
        {"nodeport_cidrs": "10.0.0.0/8"},
        S({V("10.96.0.10"): BOTH, V("10.0.0.10", 30080): BOTH}, "10.96.0.10"),
    ),
    "UDP, SCTP, and TCP by default": (
        [
            service(
                ports=[
                    port("dns", 53, "UDP", 5353),
                    port("sip", 5060, "SCTP", 5060),
                    port("http", 80, None, 8080),
                ]
            ),
            slice_(
                ports=(("dns", 5353, "UDP"), ("sip", 5060, "SCTP"), ("http", 8080, "TCP")),
                endpoints=[ep("10.244.1.1")],
            ),
        ],
        {},
        S(
            {
                V("10.96.0.10", 53, "UDP"): [R("10.244.1.1", 5353)],
                V("10.96.0.10", 5060, "SCTP"): [R("10.244.1.1", 5060)],
                V("10.96.0.10", 80, "TCP"): [R("10.244.1.1", 8080)],
            },
            "10.96.0.10",
        ),
    ),
    "multi-port, named targetPort resolved per slice by the Service port's name": (
        [
            service(ports=[port("http", 80, target="web"), port("metrics", 9090, target="m")]),
            slice_(
                ports=(("http", 8080, "TCP"), ("metrics", 9100, "TCP")),
                endpoints=[ep("10.244.1.1")],
            ),
            # pods of another version name their port differently: their own slice
            slice_(name="web-v2", ports=(("http", 8888, "TCP"),), endpoints=[ep("10.244.1.2")]),
        ],
        {},
        S(
            {
                V("10.96.0.10", 80): [R("10.244.1.1", 8080), R("10.244.1.2", 8888)],
                V("10.96.0.10", 9090): [R("10.244.1.1", 9100)],
            },
            "10.96.0.10",
        ),
    ),
    "slice ports of another name or protocol do not match": (
        [
            service(),
            slice_(
                ports=(("other", 8080, "TCP"), ("http", 8081, "UDP")), endpoints=[ep("10.244.1.1")]
            ),
        ],
        {},
        S({V("10.96.0.10"): []}, "10.96.0.10"),
    ),
    "selectorless Service with a hand-made slice": (
        [
            service("db", ports=[port("pg", 5432, target=5432)]),
            slice_(
                "db",
                name="db-manual",
                ports=(("pg", 5432, "TCP"),),
                endpoints=[ep("172.31.5.20", node="")],
            ),
        ],
        {},
        S({V("10.96.0.10", 5432): [R("172.31.5.20", 5432)]}, "10.96.0.10"),
    ),
    "only ready endpoints": (
        [
            service(),
            slice_(
                endpoints=[
                    ep("10.244.1.1"),
                    ep("10.244.1.2", ready=False, serving=True, terminating=True),
                    ep("10.244.1.3", ready=False),
                ]
            ),
        ],
        {},
        S({V("10.96.0.10"): [R("10.244.1.1")]}, "10.96.0.10"),
    ),
    "no ready endpoint: serving-and-terminating ones": (
        [
            service(),
            slice_(
                endpoints=[
                    ep("10.244.1.2", ready=False, serving=True, terminating=True),
                    ep("10.244.1.3", ready=False, serving=False, terminating=True),
                    ep("10.244.1.4", ready=False),
                    ep("10.244.1.5", ready=False, serving=True, terminating=False),
                ]
            ),
        ],
        {},
        S({V("10.96.0.10"): [R("10.244.1.2")]}, "10.96.0.10"),
    ),
    "endpoints of the wrong family are ignored": (
        [service(cluster_ips=("fd00::10",)), WEB_SLICE],
        {},
        S({V("fd00::10"): []}, "fd00::10"),
    ),
    "externalTrafficPolicy Local restricts external virtual servers only": (
        [
            service(
                type="NodePort",
                ports=[port(node_port=30080)],
                externalIPs=["198.51.100.7"],
                externalTrafficPolicy="Local",
            ),
            WEB_SLICE,
            node(),
        ],
        {},
        S(
            {
                V("10.96.0.10"): BOTH,
                V("198.51.100.7"): LOCAL,
                V("192.168.0.10", 30080): LOCAL,
            },
            "10.96.0.10",
            "198.51.100.7",
        ),
    ),
    "internalTrafficPolicy Local restricts the ClusterIP only": (
        [
            service(type="NodePort", ports=[port(node_port=30080)], internalTrafficPolicy="Local"),
            WEB_SLICE,
            node(),
        ],
        {},
        S({V("10.96.0.10"): LOCAL, V("192.168.0.10", 30080): BOTH}, "10.96.0.10"),
    ),
    "local policy, local endpoints only terminating: those are used": (
        [
            service(internalTrafficPolicy="Local"),
            slice_(
                endpoints=[
                    ep("10.244.1.1", ready=False, serving=True, terminating=True),
                    ep("10.244.2.1", node="node-b"),
                ]
            ),
        ],
        {},
        S({V("10.96.0.10"): [R("10.244.1.1")]}, "10.96.0.10"),
    ),
    "headless, ExternalName and service-proxy-name Services get nothing": (
        [
            service("headless", cluster_ips=("None",)),
            service("alias", type="ExternalName", cluster_ips=(), externalName="x.example.com"),
            service("other", labels={"service.kubernetes.io/service-proxy-name": "foo"}),
            slice_("headless", endpoints=[ep("10.244.1.1")]),
            slice_("other", endpoints=[ep("10.244.1.1")]),
        ],
        {},
        S({}),
    ),
    "sessionAffinity ClientIP: persistence, default timeout 10800": (
        [service(sessionAffinity="ClientIP"), WEB_SLICE],
        {},
        S({V("10.96.0.10", flags=1, timeout=10800): BOTH}, "10.96.0.10"),
    ),
    "sessionAffinity ClientIP with timeoutSeconds": (
        [
            service(
                sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
            ),
            WEB_SLICE,
        ],
        {},
        S({V("10.96.0.10", flags=1, timeout=60): BOTH}, "10.96.0.10"),
    ),
    "scheduler and flags by annotation": (
        [
            service(
                annotations={
                    "ipvsproxy.io/scheduler": "sh",
                    "ipvsproxy.io/scheduler-flags": "sh-fallback, sh-port",
                }
            ),
            WEB_SLICE,
        ],
        {},
        S({V("10.96.0.10", sched="sh", flags=0x18): BOTH}, "10.96.0.10"),
    ),
    "node-wide default scheduler": (
        [service(), WEB_SLICE],
        {"scheduler": Scheduler.LC},
        S({V("10.96.0.10", sched="lc"): BOTH}, "10.96.0.10"),
    ),
    "duplicate endpoints across slices count once": (
        [service(), WEB_SLICE, slice_(name="web-dup", endpoints=[ep("10.244.1.1")])],
        {},
        S({V("10.96.0.10"): BOTH}, "10.96.0.10"),
    ),
    "slices without the service-name label, or of FQDN type, are ignored": (
        [
            service(),
            slice_(name="orphan", labels={}, endpoints=[ep("10.244.1.1")]),
            {**slice_(name="fqdn"), "addressType": "FQDN", "endpoints": [{"addresses": ["a.b"]}]},
        ],
        {},
        S({V("10.96.0.10"): []}, "10.96.0.10"),
    ),
    "slices of another namespace do not match": (
        [service(), slice_(ns="other", endpoints=[ep("10.244.1.1")])],
        {},
        S({V("10.96.0.10"): []}, "10.96.0.10"),
    ),
}


@pytest.mark.parametrize(("objects", "config", "expected"), CASES.values(), ids=CASES.keys())
def test_translation(objects, config, expected):
    desired = translate(*objects, **config)
    assert desired.state == expected
    assert not [w for w in desired.warnings if "Node" not in w]


MALFORMED = {
    "bad cluster IP": service("bad", cluster_ips=("10.96.0.300",)),
    "bad external IP": service("bad", externalIPs=["not-an-ip"]),
    "port 0": service("bad", ports=[port(number=0)]),
    "port above 65535": service("bad", ports=[port(number=70000)]),
    "port not a number": service("bad", ports=[port(number="80")]),
    "unknown protocol": service("bad", ports=[port(protocol="ICMP")]),
    "no ports": service("bad", ports=[]),
    "no clusterIP": service("bad", cluster_ips=()),
    "duplicate port and protocol": service("bad", ports=[port("a", 80), port("b", 80)]),
    "duplicate port name": service("bad", ports=[port("a", 80), port("a", 81)]),
    "no spec": {"kind": "Service", "metadata": {"name": "bad", "namespace": "default"}},
    "no name": {"kind": "Service", "metadata": {"namespace": "default"}, "spec": {}},
    "affinity timeout out of range": service(
        "bad", sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}
    ),
    "unknown traffic policy": service("bad", externalTrafficPolicy="Sometimes"),
}


@pytest.mark.parametrize("bad", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_service_is_skipped_with_a_warning_others_programmed(bad):
    good = service("good", cluster_ips=("10.96.0.20",))
    desired = translate(bad, good, slice_("good", endpoints=[ep("10.244.1.1")]))
    assert desired.state == S({V("10.96.0.20"): [R("10.244.1.1")]}, "10.96.0.20")
    named = [w for w in desired.warnings if "malformed Service" in w]
    assert len(named) == 1
    assert "default/bad" in named[0] or "None" in named[0] or "bad" in named[0]


@pytest.mark.parametrize(
    "bad_slice",
    [
        slice_(endpoints=[ep("10.244.1.999")]),
        slice_(endpoints=[ep("fd00::1")]),  # wrong family for an IPv4 slice
        slice_(ports=(("http", 0, "TCP"),), endpoints=[ep("10.244.1.1")]),
        slice_(ports=(("http", 8080, "FOO"),), endpoints=[ep("10.244.1.1")]),
        {**slice_(), "addressType": "IPv5"},
        {**slice_(), "endpoints": [{"conditions": {}}]},
    ],
)
def test_malformed_slice_is_skipped_with_a_warning(bad_slice):
    good = slice_(name="web-good", endpoints=[ep("10.244.1.7")])
    desired = translate(service(), bad_slice, good)
    assert desired.state == S({V("10.96.0.10"): [R("10.244.1.7")]}, "10.96.0.10")
    assert any("malformed EndpointSlice default/web-abcde" in w for w in desired.warnings)


@pytest.mark.parametrize(
    ("annotations", "bad_value"),
    [
        ({"ipvsproxy.io/scheduler": "fastest"}, "'fastest'"),
        ({"ipvsproxy.io/scheduler": "rr", "ipvsproxy.io/scheduler-flags": "sh-port"}, "'sh-port'"),
        ({"ipvsproxy.io/scheduler": "sh", "ipvsproxy.io/scheduler-flags": "bogus"}, "'bogus'"),
    ],
)
def test_invalid_scheduler_annotation_falls_back_with_a_warning(annotations, bad_value):
    desired = translate(service(annotations=annotations), WEB_SLICE, scheduler=Scheduler.WLC)
    assert desired.state == S({V("10.96.0.10", sched="wlc"): BOTH}, "10.96.0.10")
    (warning,) = [w for w in desired.warnings if "Node" not in w]
    assert "default/web" in warning
    assert bad_value in warning


def test_two_services_claiming_one_virtual_server_first_wins_with_a_warning():
    a = service("a", cluster_ips=("10.96.0.1",), externalIPs=["198.51.100.7"])
    b = service("b", cluster_ips=("10.96.0.2",), externalIPs=["198.51.100.7"])
    desired = translate(
        b, a, slice_("a", endpoints=[ep("10.244.1.1")]), slice_("b", endpoints=[ep("10.244.1.2")])
    )
    assert desired.state.dests[V("198.51.100.7").key] == {R("10.244.1.1").key: R("10.244.1.1")}
    assert desired.origins[V("198.51.100.7").key] == "default/a:http"
    assert any("default/b:http" in w and "default/a:http" in w for w in desired.warnings)


def test_missing_node_means_no_nodeports_and_a_warning():
    desired = translate(service(type="NodePort", ports=[port(node_port=30080)]), WEB_SLICE)
    assert desired.state == S({V("10.96.0.10"): BOTH}, "10.96.0.10")
    assert any("Node 'node-a' is not in the input" in w for w in desired.warnings)


def test_origins_name_the_service_port():
    desired = translate(service("web", ns="shop", ports=[port("http", 80)]))
    assert desired.origins == {V("10.96.0.10").key: "shop/web:http"}
