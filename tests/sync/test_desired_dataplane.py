"""Issue 15 items 2, 5 and 10 in the translation, each as kube-proxy's IPVS proxier does it:

2. an externalIP or LoadBalancer IP that is one of the node's addresses is not bound to the
   dummy device (kube-proxy's `shouldBind`), so it stays out of the VIP set;
5. a Local traffic policy with no endpoint on this node uses the cluster's endpoints
   (kube-proxy PR 97081) and is counted per Service, policy and family
   (`kubeproxy_sync_proxy_rules_no_local_endpoints_total`);
10. each IP family on its own: nothing of a family the Service has no ClusterIP of.

Each test was checked by breaking the code it guards.
"""

from __future__ import annotations

from ipaddress import ip_address

from ipvsproxy.api import parse_objects
from ipvsproxy.config import Config
from ipvsproxy.sync.desired import TrafficPolicy, translate_service
from ipvsproxy.sync.desired_index import DesiredIndex
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

INTERNAL, EXTERNAL = TrafficPolicy.INTERNAL, TrafficPolicy.EXTERNAL
NODE = node(addresses=("192.168.0.10", "fd00:1::10"))
LB = {"loadBalancer": {"ingress": [{"ip": "192.168.0.10"}, {"ip": "203.0.113.1"}]}}

# ---- 2. the node's own addresses are never bound ------------------------------------------


def test_an_external_ip_that_is_a_node_address_is_served_but_not_bound():
    svc = service(externalIPs=["192.168.0.10", "198.51.100.7"])
    desired = translate(svc, WEB_SLICE, NODE)
    assert desired.state == S(
        {V("10.96.0.10"): BOTH, V("192.168.0.10"): BOTH, V("198.51.100.7"): BOTH},
        "10.96.0.10",
        "198.51.100.7",
    )


def test_a_load_balancer_ip_that_is_a_node_address_is_served_but_not_bound():
    svc = service(type="LoadBalancer", ports=[port(node_port=31000)], status=LB)
    desired = translate(svc, WEB_SLICE, NODE)
    assert V("192.168.0.10").key in desired.state.services
    assert desired.state.bound == {ip_address("10.96.0.10"), ip_address("203.0.113.1")}


def test_the_entry_itself_says_not_to_bind_and_the_index_never_binds_it():
    """What the firewall sets read (`Entry.bind`, `IpvsState.bound`), full and incremental."""
    parsed = parse_objects([service(externalIPs=["192.168.0.10"]), WEB_SLICE, NODE])
    (svc,), (node_view,) = parsed.services, parsed.nodes
    contribution = translate_service(svc, parsed.slices, node_view, Config(node_name="node-a"))
    binds = {str(k.address): e.bind for k, e in contribution.entries.items()}
    assert binds == {"10.96.0.10": True, "192.168.0.10": False}
    index = DesiredIndex()
    index.update(("default", "web"), contribution)
    assert index.state_for(contribution.entries, [ip_address("192.168.0.10")]).bound == set()


# ---- 5. Local with no local endpoint: the cluster's, counted ------------------------------

REMOTE = slice_(endpoints=[ep("10.244.2.1", node="node-b"), ep("10.244.3.1", node="node-c")])
REMOTES = [R("10.244.2.1"), R("10.244.3.1")]


def test_external_local_without_a_local_endpoint_uses_the_cluster_endpoints_and_counts():
    svc = service(type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local")
    desired = translate(svc, REMOTE, node())
    assert desired.state == S(
        {V("10.96.0.10"): REMOTES, V("192.168.0.10", 30080): REMOTES}, "10.96.0.10"
    )
    assert desired.no_local_endpoints == {(EXTERNAL, 4): 1}


def test_external_local_with_a_local_endpoint_uses_it_and_is_not_counted():
    svc = service(type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local")
    desired = translate(svc, WEB_SLICE, node())
    assert desired.state.dests[V("192.168.0.10", 30080).key] == {r.key: r for r in LOCAL}
    assert desired.no_local_endpoints == {}


def test_internal_local_on_an_internal_only_service_stays_empty_but_is_counted():
    """kube-proxy: a Service that never uses the cluster's endpoints (iTP Local, nothing
    external) has none to fall back to (CategorizeEndpoints returns no cluster set)."""
    desired = translate(service(internalTrafficPolicy="Local"), REMOTE, node())
    assert desired.state == S({V("10.96.0.10"): []}, "10.96.0.10")
    assert desired.no_local_endpoints == {(INTERNAL, 4): 1}


def test_internal_local_with_a_node_port_falls_back_to_the_cluster_endpoints():
    svc = service(type="NodePort", ports=[port(node_port=30080)], internalTrafficPolicy="Local")
    desired = translate(svc, REMOTE, node())
    assert desired.state.dests[V("10.96.0.10").key] == {r.key: r for r in REMOTES}
    assert desired.no_local_endpoints == {(INTERNAL, 4): 1}


def test_both_policies_local_are_counted_once_each_whatever_the_ports():
    svc = service(
        type="NodePort",
        ports=[port("http", 80, node_port=30080), port("https", 443, node_port=30443)],
        externalTrafficPolicy="Local",
        internalTrafficPolicy="Local",
    )
    sl = slice_(
        ports=(("http", 8080, "TCP"), ("https", 8443, "TCP")),
        endpoints=[ep("10.244.2.1", node="node-b")],
    )
    desired = translate(svc, sl, node())
    assert desired.state.dests[V("192.168.0.10", 30443).key] == {
        R("10.244.2.1", 8443).key: R("10.244.2.1", 8443)
    }
    assert desired.no_local_endpoints == {(INTERNAL, 4): 1, (EXTERNAL, 4): 1}


def test_external_policy_of_a_service_with_no_external_frontend_is_not_counted():
    """kube-proxy's ExternalPolicyLocal holds only for an externally accessible Service."""
    svc = service(internalTrafficPolicy="Local", externalTrafficPolicy="Local")
    desired = translate(svc, REMOTE, node())
    assert desired.no_local_endpoints == {(INTERNAL, 4): 1}


def test_no_endpoint_anywhere_is_not_counted():
    svc = service(type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local")
    not_serving = slice_(endpoints=[ep("10.244.2.1", ready=False, serving=False, node="node-b")])
    desired = translate(svc, not_serving, node())
    assert desired.state.dests[V("192.168.0.10", 30080).key] == {}
    assert desired.no_local_endpoints == {}


def test_a_local_terminating_endpoint_is_used_before_the_fallback():
    svc = service(type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local")
    sl = slice_(
        endpoints=[
            ep("10.244.1.1", ready=False, serving=True, terminating=True),
            ep("10.244.2.1", node="node-b"),
        ]
    )
    desired = translate(svc, sl, node())
    assert desired.state.dests[V("192.168.0.10", 30080).key] == {
        R("10.244.1.1").key: R("10.244.1.1")
    }
    assert desired.no_local_endpoints == {}


def test_the_count_is_per_family():
    svc = service(
        type="NodePort",
        cluster_ips=("10.96.0.10", "fd00::10"),
        ports=[port(node_port=30080)],
        externalTrafficPolicy="Local",
    )
    v6 = slice_(name="web-v6", family="IPv6", endpoints=[ep("fd00:244::1")])  # local
    desired = translate(svc, REMOTE, v6, NODE)
    assert desired.no_local_endpoints == {(EXTERNAL, 4): 1}
    assert desired.state.dests[V("fd00:1::10", 30080).key] == {
        R("fd00:244::1").key: R("fd00:244::1")
    }


def test_the_index_keeps_the_count_as_services_come_and_go():
    config = Config(node_name="node-a")
    parsed = parse_objects(
        [
            service(
                "a", type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local"
            ),
            service("b", cluster_ips=("10.96.0.11",), internalTrafficPolicy="Local"),
            slice_("a", endpoints=[ep("10.244.2.1", node="node-b")]),
            slice_("b", endpoints=[ep("10.244.2.2", node="node-b")]),
            slice_("b", name="b-here", endpoints=[ep("10.244.1.2")]),
            node(),
        ]
    )
    a, b = parsed.services
    (node_view,) = parsed.nodes
    slices = {s.name: s for s in parsed.slices}
    index = DesiredIndex()
    index.update(("default", "a"), translate_service(a, [slices["a-abcde"]], node_view, config))
    index.update(("default", "b"), translate_service(b, [slices["b-abcde"]], node_view, config))
    assert index.no_local_endpoints() == {(EXTERNAL, 4): 1, (INTERNAL, 4): 1}
    both = [slices["b-abcde"], slices["b-here"]]
    index.update(("default", "b"), translate_service(b, both, node_view, config))
    assert index.no_local_endpoints() == {(EXTERNAL, 4): 1}
    index.update(("default", "a"), None)
    assert index.no_local_endpoints() == {}
    assert index.desired().no_local_endpoints == {}


# ---- 10. each family on its own -----------------------------------------------------------


def test_an_ipv4_only_service_gets_nothing_in_ipv6():
    svc = service(
        type="LoadBalancer",
        ports=[port(node_port=30080)],
        externalIPs=["198.51.100.7", "2001:db8::7"],
        status={"loadBalancer": {"ingress": [{"ip": "203.0.113.1"}, {"ip": "2001:db8::1"}]}},
    )
    v6 = slice_(name="web-v6", family="IPv6", endpoints=[ep("fd00:244::1")])
    desired = translate(svc, WEB_SLICE, v6, NODE)
    assert desired.state == S(
        {
            V("10.96.0.10"): BOTH,
            V("203.0.113.1"): BOTH,
            V("198.51.100.7"): BOTH,
            V("192.168.0.10", 30080): BOTH,
        },
        "10.96.0.10",
        "203.0.113.1",
        "198.51.100.7",
    )
    assert desired.local_endpoints == {ip_address("10.244.1.1")}  # not fd00:244::1


def test_an_ipv6_only_service_gets_node_ports_on_ipv6_node_addresses_only():
    svc = service(type="NodePort", cluster_ips=("fd00::10",), ports=[port(node_port=30080)])
    v6 = slice_(name="web-v6", family="IPv6", endpoints=[ep("fd00:244::1")])
    desired = translate(svc, WEB_SLICE, v6, NODE)
    six = [R("fd00:244::1")]
    assert desired.state == S({V("fd00::10"): six, V("fd00:1::10", 30080): six}, "fd00::10")


def test_a_dual_stack_service_gets_each_family_with_its_own_endpoints():
    svc = service(
        type="NodePort",
        cluster_ips=("10.96.0.10", "fd00::10"),
        ports=[port(node_port=30080)],
        externalIPs=["2001:db8::7"],
    )
    v6 = slice_(name="web-v6", family="IPv6", endpoints=[ep("fd00:244::1")])
    desired = translate(svc, WEB_SLICE, v6, NODE)
    six = [R("fd00:244::1")]
    assert desired.state == S(
        {
            V("10.96.0.10"): BOTH,
            V("192.168.0.10", 30080): BOTH,
            V("fd00::10"): six,
            V("fd00:1::10", 30080): six,
            V("2001:db8::7"): six,
        },
        "10.96.0.10",
        "fd00::10",
        "2001:db8::7",
    )
