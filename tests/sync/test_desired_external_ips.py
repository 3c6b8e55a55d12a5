"""`--external-ip-cidrs`: a Service's externalIPs outside the allowed ranges are nowhere
(no virtual server, no bound address, no firewall record, not in `status`), with a warning
naming the Service; the default allows every address, as kube-proxy."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.api import parse_objects
from ipvsproxy.config import Config, parse_external_ip_cidrs
from ipvsproxy.sync.desired import explain_service
from tests.factories import BOTH, WEB_SLICE, S, V, node, parse_service, parse_slice, service
from tests.factories import translate as _translate

DUAL = ("10.96.0.10", "fd00::10")


def translate(*objects, cidrs: str | None = None):
    if cidrs is None:
        return _translate(*objects)
    return _translate(*objects, external_ip_cidrs=parse_external_ip_cidrs(cidrs, option="t"))


def refusals(desired) -> list[str]:
    return [w for w in desired.warnings if "--external-ip-cidrs" in w]


def test_default_allows_every_external_ip_as_kube_proxy():
    svc = service(externalIPs=["198.51.100.7", "192.168.0.10"])
    desired = translate(svc, WEB_SLICE, node())
    assert {V("198.51.100.7").key, V("192.168.0.10").key} <= set(desired.state.services)
    assert refusals(desired) == []


def test_an_allowed_external_ip_is_served_and_bound():
    desired = translate(service(externalIPs=["198.51.100.7"]), WEB_SLICE, cidrs="198.51.100.0/24")
    assert desired.state == S({V("10.96.0.10"): BOTH, V("198.51.100.7"): BOTH},
                              "10.96.0.10", "198.51.100.7")  # fmt: skip
    assert refusals(desired) == []


def test_a_refused_external_ip_has_no_virtual_server_address_or_firewall_record():
    svc = service(externalIPs=["198.51.100.7", "203.0.113.9"])
    desired = translate(svc, WEB_SLICE, cidrs="198.51.100.0/24")
    refused = V("203.0.113.9").key
    assert refused not in desired.state.services
    assert refused not in desired.access  # what the firewall sets and rules render
    assert ip_address("203.0.113.9") not in desired.state.bound
    assert V("198.51.100.7").key in desired.state.services
    (warning,) = refusals(desired)
    assert "default/web" in warning
    assert "203.0.113.9" in warning


def test_a_nodes_own_address_is_refused_like_any_other():
    svc = service(externalIPs=["192.168.0.10"])
    desired = translate(svc, WEB_SLICE, node(addresses=("192.168.0.10",)), cidrs="198.51.100.0/24")
    assert desired.state == S({V("10.96.0.10"): BOTH}, "10.96.0.10")
    assert "192.168.0.10" in refusals(desired)[0]


def test_ipv6_is_refused_and_allowed_by_its_own_ranges():
    svc = service(cluster_ips=DUAL, externalIPs=["2001:db8::7", "2001:db9::7", "198.51.100.7"])
    desired = translate(svc, cidrs="2001:db8::/32")
    services = set(desired.state.services)
    assert V("2001:db8::7").key in services
    assert V("2001:db9::7").key not in services
    assert V("198.51.100.7").key not in services  # a family with no range gets none
    assert len(refusals(desired)) == 2


def test_none_refuses_every_external_ip_and_leaves_load_balancer_ips_alone():
    lb = {"loadBalancer": {"ingress": [{"ip": "203.0.113.1"}]}}
    svc = service(
        type="LoadBalancer",
        externalIPs=["198.51.100.7"],
        ports=[{"name": "http", "port": 80, "nodePort": 31000}],
        status=lb,
    )
    desired = translate(svc, WEB_SLICE, node(), cidrs="none")
    services = set(desired.state.services)
    assert V("198.51.100.7").key not in services
    assert V("203.0.113.1").key in services


def test_status_explains_the_same_translation_without_the_refused_address():
    svc = parse_service(service(externalIPs=["203.0.113.9"]))
    config = Config(node_name="node-a", external_ip_cidrs=(ip_network("198.51.100.0/24"),))
    (node_view,) = parse_objects([node()]).nodes
    explained = explain_service(svc, [parse_slice(WEB_SLICE)], node_view, config)
    keys = {str(k.address) for k in explained.contribution.entries}
    assert keys == {"10.96.0.10"}
    assert any("203.0.113.9" in w for w in explained.contribution.warnings)


ADDRESSES = st.one_of(
    st.integers(0, 2**32 - 1).map(IPv4Address),
    st.integers(0, 2**128 - 1).map(IPv6Address),
)


@given(address=ADDRESSES, other=ADDRESSES, prefix=st.integers(0, 32))
def test_an_external_ip_is_served_exactly_when_a_range_holds_it(address, other, prefix):
    width = 32 if other.version == 4 else 128
    net = ip_network(f"{other}/{prefix * width // 32}", strict=False)
    svc = service(cluster_ips=DUAL, externalIPs=[str(address)])
    desired = translate(svc, cidrs=str(net))
    served = V(str(address)).key in desired.state.services
    assert served == (address in net)
    assert bool(refusals(desired)) == (address not in net)
