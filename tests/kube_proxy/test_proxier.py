"""kube-proxy's own IPVS expectations, ported from its proxier tests.

Each case is a test of kubernetes/kubernetes `pkg/proxy/ipvs/proxier_test.go` that builds
Services and EndpointSlices and asserts virtual and real servers: the same inputs as raw
objects, the same expected table. kube-proxy runs one proxier per IP family
(`NewFakeProxier(..., v1.IPv4Protocol)`); ipvsproxy translates both families at once, so a
case names the family its kube-proxy proxier had and compares the virtual servers of that
family (the other family is what the other proxier would program). The node is kube-proxy's
`testHostname`; its node IPs are the Node object's addresses. Where kube-proxy's test only
counts virtual servers or checks one of them, the case gives the whole table kube-proxy
programs, and says so. Where ipvsproxy differs on purpose, the case says why.
"""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

import pytest

from ipvsproxy.model import RealServer
from tests.factories import R, V, ep, node, port, service, slice_, translate

HOST = "test-hostname"  # kube-proxy's testHostname
NODE_V4_V6 = node(HOST, addresses=("100.101.102.103", "2001:db8::1:1"))
NODE_V4 = node(HOST, addresses=("100.101.102.103",))


def np_service(cluster_ip: str, proto: str = "TCP", **spec: Any) -> Any:
    """makeTestService("ns1", "svc1") with one port p80/80 and node port 3001."""
    return service(
        "svc1",
        ns="ns1",
        type="NodePort",
        cluster_ips=(cluster_ip,),
        ports=[port("p80", 80, proto, node_port=3001)],
        **spec,
    )


def eps(family: str, *endpoints: dict[str, Any], proto: str = "TCP", n: int = 1, name="p80"):
    """makeTestEndpointSlice("ns1", "svc1", n) with one port `name`/80."""
    return slice_(
        "svc1",
        name=f"svc1-{n}",
        ns="ns1",
        family=family,
        ports=((name, 80, proto),),
        endpoints=endpoints,
    )


def a(address: str, node_name: str | None = None, **conditions: Any) -> Any:
    """An endpoint; kube-proxy's test endpoints have no node name unless given."""
    return ep(address, node=node_name or "", **conditions)


def at(address: str, ready: bool, serving: bool, terminating: bool, node_name: str):
    return a(address, node_name, ready=ready, serving=serving, terminating=terminating)


Table = dict[Any, list[RealServer]]

# name: (objects, config, family, expected table {virtual server: real servers}, extra)
# extra: "local" = this node's endpoint addresses (kube-proxy's KUBE-LOOP-BACK entries),
# "bound" = the family's addresses on the dummy device.
CASES: dict[str, tuple[list[Any], dict[str, Any], int, Table, dict[str, Any]]] = {
    # ---- TestNodePortIPv4 ----------------------------------------------------------------
    "TestNodePortIPv4/1 service with node port, has 2 endpoints": (
        [
            np_service("10.20.30.41"),
            eps("IPv4", a("10.180.0.1")),
            eps("IPv6", a("1002:ab8::2:10"), n=2),
            NODE_V4_V6,
        ],
        {},
        4,
        {
            V("10.20.30.41", 80): [R("10.180.0.1", 80)],
            V("100.101.102.103", 3001): [R("10.180.0.1", 80)],
        },
        {},
    ),
    "TestNodePortIPv4/1 UDP service with node port, has endpoints": (
        [np_service("10.20.30.41", "UDP"), eps("IPv4", a("10.180.0.1"), proto="UDP"), NODE_V4],
        {"nodeport_cidrs": "0.0.0.0/0"},
        4,
        {
            V("10.20.30.41", 80, "UDP"): [R("10.180.0.1", 80)],
            V("100.101.102.103", 3001, "UDP"): [R("10.180.0.1", 80)],
        },
        {},
    ),
    "TestNodePortIPv4/service has node port but no endpoints": (
        [np_service("10.20.30.41"), NODE_V4],
        {},
        4,
        {V("10.20.30.41", 80): [], V("100.101.102.103", 3001): []},
        {},
    ),
    "TestNodePortIPv4/node port service with protocol sctp on a node with multiple nodeIPs": (
        [
            np_service("10.20.30.41", "SCTP"),
            eps("IPv4", a("10.180.0.1"), proto="SCTP"),
            node(
                HOST,
                addresses=(
                    "100.101.102.103",
                    "100.101.102.104",
                    "100.101.102.105",
                    "2001:db8::1:1",
                    "2001:db8::1:2",
                    "2001:db8::1:3",
                ),
            ),
        ],
        {},
        4,
        {
            V("10.20.30.41", 80, "SCTP"): [R("10.180.0.1", 80)],
            V("100.101.102.103", 3001, "SCTP"): [R("10.180.0.1", 80)],
            V("100.101.102.104", 3001, "SCTP"): [R("10.180.0.1", 80)],
            V("100.101.102.105", 3001, "SCTP"): [R("10.180.0.1", 80)],
        },
        {},
    ),
    "TestNodePortIPv4/node port service with protocol sctp and externalTrafficPolicy local": (
        [
            np_service("10.20.30.41", "SCTP", externalTrafficPolicy="Local"),
            eps("IPv4", a("10.180.0.1", HOST), a("10.180.1.1", "otherHost"), proto="SCTP"),
            NODE_V4,
        ],
        {},
        4,
        {
            V("10.20.30.41", 80, "SCTP"): [R("10.180.0.1", 80), R("10.180.1.1", 80)],
            V("100.101.102.103", 3001, "SCTP"): [R("10.180.0.1", 80)],
        },
        {},
    ),
    # ---- TestNodePortIPv6 ----------------------------------------------------------------
    "TestNodePortIPv6/1 service with node port, has 2 endpoints": (
        [
            np_service("2020::1"),
            eps("IPv4", a("10.180.0.1")),
            eps("IPv6", a("1002:ab8::2:10"), n=2),
            NODE_V4_V6,
        ],
        {},
        6,
        {
            V("2001:db8::1:1", 3001): [R("1002:ab8::2:10", 80)],
            V("2020::1", 80): [R("1002:ab8::2:10", 80)],
        },
        {},
    ),
    "TestNodePortIPv6/1 UDP service with node port, has endpoints (no action on IPv6 Proxier)": (
        # the slice says IPv6 but holds an IPv4 address: ipvsproxy skips it as malformed
        [np_service("10.20.30.41", "UDP"), eps("IPv6", a("10.180.0.1"), proto="UDP"), NODE_V4],
        {"nodeport_cidrs": "0.0.0.0/0"},
        6,
        {},
        {},
    ),
    "TestNodePortIPv6/service has node port but no endpoints": (
        [np_service("2020::1"), NODE_V4_V6],
        {},
        6,
        {V("2001:db8::1:1", 3001): [], V("2020::1", 80): []},
        {},
    ),
    "TestNodePortIPv6/node port service with protocol sctp on a node with multiple nodeIPs": (
        [
            np_service("2020::1", "SCTP"),
            eps("IPv6", a("2001::1"), proto="SCTP"),
            node(HOST, addresses=("2001:db8::1:1", "2001:db8::1:2")),
        ],
        {},
        6,
        {
            V("2001:db8::1:1", 3001, "SCTP"): [R("2001::1", 80)],
            V("2001:db8::1:2", 3001, "SCTP"): [R("2001::1", 80)],
            V("2020::1", 80, "SCTP"): [R("2001::1", 80)],
        },
        {},
    ),
    # ---- TestIPv4Proxier / TestIPv6Proxier -----------------------------------------------
    **{
        f"TestIPv{family}Proxier/2 services with Cluster IP, each with endpoints": (
            [
                service("svc1", ns="ns1", cluster_ips=("10.20.30.41",), ports=[port("p80", 80)]),
                service(
                    "svc2", ns="ns2", cluster_ips=("1002:ab8::2:1",), ports=[port("p8080", 8080)]
                ),
                eps("IPv4", a("10.180.0.1")),
                slice_(
                    "svc2",
                    name="svc2-1",
                    ns="ns2",
                    family="IPv6",
                    ports=(("p8080", 8080, "TCP"),),
                    endpoints=[a("1009:ab8::5:6")],
                ),
            ],
            {},
            family,
            {V("10.20.30.41", 80): [R("10.180.0.1", 80)]}
            if family == 4
            else {V("1002:ab8::2:1", 8080): [R("1009:ab8::5:6", 8080)]},
            {},
        )
        for family in (4, 6)
    },
    "TestIPv4Proxier/cluster IP service with no endpoints": (
        [service("svc1", ns="ns1", cluster_ips=("10.20.30.41",), ports=[port("p80", 80)])],
        {},
        4,
        {V("10.20.30.41", 80): []},
        {},
    ),
    "TestIPv6Proxier/cluster IP service with no endpoints": (
        [service("svc1", ns="ns1", cluster_ips=("2001::1",), ports=[port("p80", 80)])],
        {},
        6,
        {V("2001::1", 80): []},
        {},
    ),
    # ---- externalIPs -----------------------------------------------------------------------
    "TestExternalIPsNoEndpoint": (
        [
            service(
                "svc1",
                ns="ns1",
                cluster_ips=("10.20.30.41",),
                ports=[port("p80", 80)],
                externalIPs=["50.60.70.81"],
            )
        ],
        {},
        4,
        {V("10.20.30.41", 80): [], V("50.60.70.81", 80): []},
        {"bound": {"10.20.30.41", "50.60.70.81"}},
    ),
    "TestExternalIPs": (
        # kube-proxy counts 3 virtual servers ("ipvs filters out by ipfamily": 2012::51 is
        # dropped) and its destination loop is vacuous: the slice port is UDP and the
        # Service port TCP, so no endpoint matches; the whole table is this
        [
            service(
                "svc1",
                ns="ns1",
                cluster_ips=("10.20.30.41",),
                ports=[port("p80", 80)],
                externalIPs=["50.60.70.81", "2012::51", "127.0.0.1"],
            ),
            eps("IPv4", a("10.180.0.1"), proto="UDP"),
        ],
        {},
        4,
        {V("10.20.30.41", 80): [], V("50.60.70.81", 80): [], V("127.0.0.1", 80): []},
        {"bound": {"10.20.30.41", "50.60.70.81", "127.0.0.1"}},
    ),
    "TestOnlyLocalExternalIPs": (
        # kube-proxy: 3 virtual servers, the externalIPs with the one local endpoint; the
        # NodePort Service has no nodePort and the fake proxier no node IPs
        [
            service(
                "svc1",
                ns="ns1",
                type="NodePort",
                cluster_ips=("10.20.30.41",),
                ports=[port("p80", 80)],
                externalIPs=["50.60.70.81", "2012::51", "127.0.0.1"],
                externalTrafficPolicy="Local",
            ),
            eps("IPv4", a("10.180.0.1", HOST), a("10.180.1.1", "other-hostname")),
        ],
        {},
        4,
        {
            V("10.20.30.41", 80): [R("10.180.0.1", 80), R("10.180.1.1", 80)],
            V("50.60.70.81", 80): [R("10.180.0.1", 80)],
            V("127.0.0.1", 80): [R("10.180.0.1", 80)],
        },
        {"bound": {"10.20.30.41", "50.60.70.81", "127.0.0.1"}},
    ),
    # ---- LoadBalancer ------------------------------------------------------------------------
    "TestLoadBalancer": (
        # kube-proxy: 2 virtual servers (no node IPs); it looks the LB one up on the node
        # port, finds none, and checks nothing else; the slice port is UDP: no destination
        [
            service(
                "svc1",
                ns="ns1",
                type="LoadBalancer",
                cluster_ips=("10.20.30.41",),
                ports=[port("p80", 80, node_port=3001)],
                status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}},
            ),
            eps("IPv4", a("10.180.0.1"), proto="UDP"),
        ],
        {},
        4,
        {V("10.20.30.41", 80): [], V("1.2.3.4", 80): []},
        {"bound": {"10.20.30.41", "1.2.3.4"}},
    ),
    "TestLoadBalancerSourceRanges": (
        [
            service(
                "svc1",
                ns="ns1",
                type="LoadBalancer",
                cluster_ips=("10.20.30.41",),
                ports=[port("p80", 80)],
                status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}},
                loadBalancerSourceRanges=["10.0.0.0/8"],
            ),
            eps("IPv4", a("10.180.0.1")),
        ],
        {},
        4,
        {V("10.20.30.41", 80): [R("10.180.0.1", 80)], V("1.2.3.4", 80): [R("10.180.0.1", 80)]},
        {},
    ),
    "TestOnlyLocalLoadBalancing": (
        [
            service(
                "svc1",
                ns="ns1",
                type="LoadBalancer",
                cluster_ips=("10.20.30.41",),
                ports=[port("p80", 80, node_port=3001)],
                status={"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}},
                externalTrafficPolicy="Local",
            ),
            eps("IPv4", a("10.180.0.1", HOST), a("10.180.1.1", "other-hostname")),
        ],
        {},
        4,
        {
            V("10.20.30.41", 80): [R("10.180.0.1", 80), R("10.180.1.1", 80)],
            V("1.2.3.4", 80): [R("10.180.0.1", 80)],
        },
        {"local": {"10.180.0.1"}},
    ),
    "TestOnlyLocalNodePorts": (
        # kube-proxy: 2 virtual servers "matching ipvs IPFamily", the node port with the
        # local endpoint; the IPv6 interface address is the other proxier's
        [
            np_service("10.20.30.41", externalTrafficPolicy="Local"),
            eps("IPv4", a("10.180.0.1", HOST), a("10.180.1.1", "other-hostname")),
            node(HOST, addresses=("100.101.102.103", "2001:db8::")),
        ],
        {"nodeport_cidrs": "100.101.102.0/24,2001:db8::0/64"},
        4,
        {
            V("10.20.30.41", 80): [R("10.180.0.1", 80), R("10.180.1.1", 80)],
            V("100.101.102.103", 3001): [R("10.180.0.1", 80)],
        },
        {},
    ),
    # ---- EndpointSlices and internalTrafficPolicy ----------------------------------------
    # kube-proxy's Services here leave `port` unset (0), which the API server never admits
    # and ipvsproxy skips as malformed: ported with port 80 (the endpoints' port)
    "TestEndpointSliceE2E": (
        [
            service("svc1", ns="ns1", cluster_ips=("172.20.1.1",), ports=[port("", 80)]),
            eps(
                "IPv4",
                a("10.0.1.1", HOST),
                a("10.0.1.2", "node2"),
                a("10.0.1.3", "node3"),
                a("10.0.1.4", "node3", ready=False),  # not ready: ignored
                name="",
            ),
        ],
        {},
        4,
        {V("172.20.1.1", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.3", 80)]},
        {"local": {"10.0.1.1"}},
    ),
    **{
        f"TestTestInternalTrafficPolicyE2E/internalTrafficPolicy is {policy.lower()} with "
        f"{'non-zero' if here else 'zero'} local endpoints": (
            [
                service(
                    "svc1",
                    ns="ns1",
                    cluster_ips=("172.20.1.1",),
                    ports=[port("", 80)],
                    internalTrafficPolicy=policy,
                ),
                eps(
                    "IPv4",
                    a("10.0.1.1", HOST if here else "host0"),
                    a("10.0.1.2", "host1"),
                    a("10.0.1.3", "host2"),
                    name="",
                ),
            ],
            {},
            4,
            {V("172.20.1.1", 80): expected},
            {"local": {"10.0.1.1"} if here else set()},
        )
        for policy, here, expected in (
            ("Cluster", True, [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.3", 80)]),
            ("Cluster", False, [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.3", 80)]),
            ("Local", True, [R("10.0.1.1", 80)]),
            # kube-proxy: no real server (an internal-only Service has no cluster set to
            # fall back to); its test skips the table here, the virtual server exists
            ("Local", False, []),
        )
    },
    # ---- ready and terminating endpoints -----------------------------------------------------
    "Test_EndpointSliceReadyAndTerminatingCluster": (
        [
            service(
                "svc1",
                ns="ns1",
                type="NodePort",
                cluster_ips=("172.20.1.1",),
                ports=[port("", 80)],
                externalTrafficPolicy="Cluster",
                internalTrafficPolicy="Cluster",
                externalIPs=["1.2.3.4"],
            ),
            eps(
                "IPv4",
                at("10.0.1.1", True, True, False, HOST),
                at("10.0.1.2", True, True, False, HOST),
                at("10.0.1.3", False, True, True, HOST),
                at("10.0.1.4", False, False, True, HOST),
                at("10.0.1.5", True, True, False, "another-host"),
                name="",
            ),
        ],
        {},
        4,
        {
            V("172.20.1.1", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.5", 80)],
            V("1.2.3.4", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.5", 80)],
        },
        {"local": {"10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4"}},
    ),
    "Test_EndpointSliceReadyAndTerminatingLocal": (
        [
            service(
                "svc1",
                ns="ns1",
                type="NodePort",
                cluster_ips=("172.20.1.1",),
                ports=[port("", 80)],
                externalTrafficPolicy="Local",
                internalTrafficPolicy="Cluster",
                externalIPs=["1.2.3.4"],
            ),
            eps(
                "IPv4",
                at("10.0.1.1", True, True, False, HOST),
                at("10.0.1.2", True, True, False, HOST),
                at("10.0.1.3", False, True, True, HOST),
                at("10.0.1.4", False, False, True, HOST),
                at("10.0.1.5", True, True, False, "another-host"),
                name="",
            ),
        ],
        {},
        4,
        {
            V("172.20.1.1", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.5", 80)],
            V("1.2.3.4", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80)],
        },
        {"local": {"10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4"}},
    ),
    "Test_EndpointSliceOnlyReadyAndTerminatingCluster": (
        [
            service(
                "svc1",
                ns="ns1",
                type="NodePort",
                cluster_ips=("172.20.1.1",),
                ports=[port("", 80)],
                externalTrafficPolicy="Cluster",
                internalTrafficPolicy="Cluster",
                externalIPs=["1.2.3.4"],
            ),
            eps(
                "IPv4",
                at("10.0.1.1", False, True, True, HOST),
                at("10.0.1.2", False, True, True, HOST),
                at("10.0.1.3", False, False, True, HOST),
                at("10.0.1.4", False, True, True, "another-host"),
                at("10.0.1.5", False, False, False, "another-host"),
                name="",
            ),
        ],
        {},
        4,
        {
            V("172.20.1.1", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.4", 80)],
            V("1.2.3.4", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80), R("10.0.1.4", 80)],
        },
        {"local": {"10.0.1.1", "10.0.1.2", "10.0.1.3"}},
    ),
    "Test_EndpointSliceOnlyReadyAndTerminatingLocal": (
        [
            service(
                "svc1",
                ns="ns1",
                type="NodePort",
                cluster_ips=("172.20.1.1",),
                ports=[port("", 80)],
                externalTrafficPolicy="Local",
                internalTrafficPolicy="Cluster",
                externalIPs=["1.2.3.4"],
            ),
            eps(
                "IPv4",
                at("10.0.1.1", False, True, True, HOST),
                at("10.0.1.2", False, True, True, HOST),
                at("10.0.1.3", False, False, True, HOST),
                at("10.0.1.4", False, True, True, "another-host"),
                at("10.0.1.5", True, True, False, "another-host"),
                name="",
            ),
        ],
        {},
        4,
        {
            V("172.20.1.1", 80): [R("10.0.1.5", 80)],
            V("1.2.3.4", 80): [R("10.0.1.1", 80), R("10.0.1.2", 80)],
        },
        {"local": {"10.0.1.1", "10.0.1.2", "10.0.1.3"}},
    ),
}


@pytest.mark.parametrize(
    ("objects", "config", "family", "expected", "extra"), CASES.values(), ids=CASES.keys()
)
def test_kube_proxy_ipvs_case(objects, config, family, expected, extra):
    desired = translate(*objects, node_name=HOST, **config)
    got = {
        vs: sorted(desired.state.dests[key].values(), key=lambda r: r.key)
        for key, vs in desired.state.services.items()
        if key.address.version == family
    }
    want = {vs: sorted(rss, key=lambda r: r.key) for vs, rss in expected.items()}
    assert got == want
    # the other family is the other proxier's: only Services with a ClusterIP of it
    families = {
        f"{o['metadata']['namespace']}/{o['metadata']['name']}": {
            ip_address(ip).version for ip in o["spec"]["clusterIPs"]
        }
        for o in objects
        if o["kind"] == "Service"
    }
    for key in desired.state.services:
        owner = desired.origins[key].rsplit(":", 1)[0]
        assert key.address.version in families[owner], (key, owner)
    if "bound" in extra:
        bound = {a for a in desired.state.bound if a.version == family}
        assert bound == {ip_address(b) for b in extra["bound"]}
    if "local" in extra:
        assert desired.local_endpoints == {ip_address(b) for b in extra["local"]}
    assert not [w for w in desired.warnings if "already used" in w]


def test_every_case_is_counted():
    """The README states how many of kube-proxy's cases are ported and pass."""
    assert len(CASES) == 29
