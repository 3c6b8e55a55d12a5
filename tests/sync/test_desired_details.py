"""Translation details that the table in test_desired.py does not see: each virtual server's
access (kind, traffic policy, source ranges), which duplicate endpoint wins, claims within
one Service, and the edges of what is translated at all. Each test here was checked by
breaking the code it guards (scripts/mutants)."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

from ipvsproxy.api import (
    EndpointPortView,
    EndpointSliceView,
    EndpointView,
    NodeView,
    ServicePortView,
    ServiceView,
)
from ipvsproxy.config import Config
from ipvsproxy.model import Proto
from ipvsproxy.policy import Frontend
from ipvsproxy.schedulers import Scheduler
from ipvsproxy.sync.desired import Access, Contribution, translate_service
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

RANGES = ["198.51.100.0/24", "2001:db8::/64"]
LB_STATUS = {"loadBalancer": {"ingress": [{"ip": "203.0.113.1"}]}}


def lb_service(**spec):
    return service(
        type="LoadBalancer",
        ports=[port(node_port=31000)],
        status=LB_STATUS,
        **{"externalIPs": ["198.51.100.7"], "loadBalancerSourceRanges": RANGES, **spec},
    )


def test_source_ranges_reach_only_the_load_balancer_ingress_entries():
    """Issue 14: no test noticed loadBalancerSourceRanges applied to ClusterIP or NodePort
    frontends (which must stay reachable from anywhere in the cluster)."""
    desired = translate(lb_service(), WEB_SLICE, node())
    ranges = tuple(ip_network(r) for r in RANGES)
    assert desired.access == {
        V("10.96.0.10").key: Access(Frontend.CLUSTER_IP),
        V("198.51.100.7").key: Access(Frontend.EXTERNAL_IP),
        V("203.0.113.1").key: Access(Frontend.LOAD_BALANCER, source_ranges=ranges),
        V("192.168.0.10", 31000).key: Access(Frontend.NODE_PORT),
    }


def test_an_address_both_load_balancer_ip_and_external_ip_keeps_the_source_ranges():
    """The same IP as a LoadBalancer ingress and an externalIP is one virtual server; it
    keeps the LoadBalancer's source ranges (fail closed), whatever order lists it."""
    desired = translate(lb_service(externalIPs=["203.0.113.1"]), WEB_SLICE, node())
    ranges = tuple(ip_network(r) for r in RANGES)
    assert desired.access[V("203.0.113.1").key] == Access(
        Frontend.LOAD_BALANCER, source_ranges=ranges
    )
    assert not [w for w in desired.warnings if "already used" in w]


def test_external_traffic_policy_local_marks_and_restricts_every_external_frontend():
    desired = translate(lb_service(externalTrafficPolicy="Local"), WEB_SLICE, node())
    local = {key for key, access in desired.access.items() if access.local}
    assert local == {
        V("198.51.100.7").key,
        V("203.0.113.1").key,
        V("192.168.0.10", 31000).key,
    }
    assert desired.state == S(
        {
            V("10.96.0.10"): BOTH,  # internal: every endpoint
            V("198.51.100.7"): LOCAL,
            V("203.0.113.1"): LOCAL,  # the load balancer's ingress too
            V("192.168.0.10", 31000): LOCAL,
        },
        "10.96.0.10",
        "198.51.100.7",
        "203.0.113.1",
    )


# ---- duplicate endpoints: the ready one wins -------------------------------------------------


def test_a_ready_duplicate_wins_over_a_not_ready_one_in_either_order_and_slice():
    """Issue 14: no test noticed losing the preference for a ready endpoint among duplicates
    (the same address in two slices, or twice in one)."""
    ready, not_ready = ep("10.244.1.1"), ep("10.244.1.1", ready=False)
    layouts = {
        "ready first, one slice": [slice_(endpoints=[ready, not_ready])],
        "ready last, one slice": [slice_(endpoints=[not_ready, ready])],
        "ready first, two slices": [
            slice_(name="web-1", endpoints=[ready]),
            slice_(name="web-2", endpoints=[not_ready]),
        ],
        "ready last, two slices": [
            slice_(name="web-1", endpoints=[not_ready]),
            slice_(name="web-2", endpoints=[ready]),
        ],
    }
    for layout, slices in layouts.items():
        desired = translate(service(), *slices)
        assert desired.state == S({V("10.96.0.10"): [R("10.244.1.1")]}, "10.96.0.10"), layout


def test_a_duplicate_not_ready_and_not_terminating_endpoint_does_not_bring_back_the_fallback():
    """The not-ready duplicate must not replace the ready one: with it, the Service would
    have no ready endpoint and fall back to serving-and-terminating ones."""
    slices = [
        slice_(name="web-1", endpoints=[ep("10.244.1.1"), ep("10.244.1.2", ready=False,
                                                             serving=True, terminating=True)]),
        slice_(name="web-2", endpoints=[ep("10.244.1.1", ready=False)]),
    ]  # fmt: skip
    desired = translate(service(), *slices)
    assert desired.state == S({V("10.96.0.10"): [R("10.244.1.1")]}, "10.96.0.10")


def test_a_slice_listing_one_port_name_twice_uses_the_first():
    bad = slice_(ports=(("http", 8080, "TCP"), ("http", 9090, "TCP")), endpoints=[ep("10.244.1.1")])
    desired = translate(service(), bad)
    assert desired.state == S({V("10.96.0.10"): [R("10.244.1.1", 8080)]}, "10.96.0.10")


# ---- claims within one Service -----------------------------------------------------------------


def test_the_same_address_twice_in_one_service_is_harmless_and_the_first_claim_stays():
    svc = service(externalIPs=["10.96.0.10", "198.51.100.7", "198.51.100.7", "198.51.100.8"])
    desired = translate(svc, WEB_SLICE)
    assert desired.state == S(
        {V("10.96.0.10"): BOTH, V("198.51.100.7"): BOTH, V("198.51.100.8"): BOTH},
        "10.96.0.10",
        "198.51.100.7",
        "198.51.100.8",
    )
    assert desired.access[V("10.96.0.10").key] == Access(Frontend.CLUSTER_IP)  # not external
    assert [w for w in desired.warnings if "Node" not in w] == []


def test_two_ports_of_one_service_claiming_one_virtual_server_warn():
    # port "a" on the externalIP 192.168.0.10:30080 and port "b"'s NodePort on the same
    # node address and number
    svc = service(
        type="NodePort",
        externalIPs=["192.168.0.10"],
        ports=[port("a", 30080, node_port=31001), port("b", 80, node_port=30080)],
    )
    desired = translate(svc, slice_(ports=(("a", 8080, "TCP"), ("b", 9090, "TCP"))), node())
    key = V("192.168.0.10", 30080).key
    assert desired.origins[key] == "default/web:a"
    assert desired.access[key] == Access(Frontend.EXTERNAL_IP)
    assert [w for w in desired.warnings if "already used" in w] == [
        f"Service default/web:b: {key} is already used by default/web:a"
    ]


# ---- what is translated at all ----------------------------------------------------------------


def test_a_node_port_on_a_cluster_ip_service_is_ignored():
    desired = translate(service(ports=[port(node_port=30080)]), WEB_SLICE, node())
    assert desired.state == S({V("10.96.0.10"): BOTH}, "10.96.0.10")


def test_affinity_keeps_the_scheduler_flags():
    annotations = {"ipvsproxy.io/scheduler": "sh", "ipvsproxy.io/scheduler-flags": "sh-port"}
    affinity = {"sessionAffinity": "ClientIP"}
    desired = translate(service(annotations=annotations, **affinity), WEB_SLICE)
    (vs,) = desired.state.services.values()
    assert vs.scheduler is Scheduler.SH
    assert vs.flags == 0x1 | 0x10  # PERSISTENT and SCHED2 (sh-port)
    assert vs.timeout_s == 10800


def test_a_headless_service_contributes_no_local_endpoint():
    headless = service("db", cluster_ips=("None",))
    desired = translate(headless, slice_("db", endpoints=[ep("10.244.1.1")]), node())
    assert desired.state.services == {}
    assert desired.local_endpoints == frozenset()
    # the parser keeps no ports of a headless Service; the translation does not rely on it
    view = ServiceView("default", "db", headless=True, ports=(HTTP,))
    assert translate_service(view, [db_slice()], NodeView("node-a"), NODE_A) == Contribution()


def test_with_its_node_present_the_translation_warns_of_nothing():
    assert translate(service(), WEB_SLICE, node()).warnings == ()


def test_without_its_node_the_warning_says_what_to_set():
    assert translate(service(), WEB_SLICE).warnings == (
        "Node 'node-a' is not in the input: no NodePort virtual servers "
        "(set --hostname-override to the node's name)",
    )


def test_fqdn_slices_are_ignored_even_with_endpoints():
    """The parser gives FQDN slices no endpoints; the translation does not rely on it."""
    svc = ServiceView("default", "db", cluster_ips=(ip_address("10.96.0.10"),), ports=(HTTP,))
    contribution = translate_service(svc, [db_slice("FQDN")], NodeView("node-a"), NODE_A)
    (entry,) = contribution.entries.values()
    assert entry.dests == {}


HTTP = ServicePortView("http", Proto.TCP, 80)
NODE_A = Config(node_name="node-a")


def db_slice(address_type: str = "IPv4") -> EndpointSliceView:
    """A parsed slice of Service default/db with one endpoint on node-a."""
    return EndpointSliceView(
        "default",
        "db-1",
        "db",
        address_type,
        (EndpointPortView("http", Proto.TCP, 8080),),
        (EndpointView(ip_address("10.244.1.1"), node_name="node-a"),),
    )
