"""Topology-aware routing from raw objects: endpoints' `hints.forNodes` / `hints.forZones`
against this node's name and `topology.kubernetes.io/zone` label, end to end from raw
EndpointSlices and a Node object to real servers (kube-proxy's own table for
`categorize_endpoints()` is tests/kube_proxy/test_topology.py). Each test was checked by
breaking the code it guards.
"""

from __future__ import annotations

import pytest

from tests.factories import (
    R,
    V,
    ep,
    node,
    parse_node,
    parse_slice,
    port,
    service,
    slice_,
    translate,
)

# ---- from raw objects ------------------------------------------------------------------


def hinted(address, zones=(), nodes=(), **kw):
    e = ep(address, **kw)
    e["hints"] = {
        "forZones": [{"name": z} for z in zones],
        "forNodes": [{"name": n} for n in nodes],
    }
    return e


def zoned_node(zone="zone-a", name="node-a"):
    n = node(name)
    n["metadata"]["labels"] = {"topology.kubernetes.io/zone": zone, "other.io/x": "y"}
    return n


def test_hints_and_the_zone_label_are_parsed():
    s = parse_slice(slice_(endpoints=[hinted("10.244.1.1", ("zone-a", "zone-b"), ("node-a",))]))
    (e,) = s.endpoints
    assert e.zone_hints == {"zone-a", "zone-b"}
    assert e.node_hints == {"node-a"}
    assert parse_slice(slice_(endpoints=[ep("10.244.1.1")])).endpoints[0].zone_hints == set()
    n = parse_node(zoned_node("zone-b"))
    assert n.zone == "zone-b"
    assert "other.io/x" not in n.labels  # only the prefixes the views keep


@pytest.mark.parametrize(
    ("hints", "field"),
    [
        ("zone-a", "endpoints[0].hints"),
        ({"forZones": "zone-a"}, "endpoints[0].hints.forZones"),
        ({"forZones": ["zone-a"]}, "endpoints[0].hints.forZones[0]"),
        ({"forZones": [{"name": 5}]}, "endpoints[0].hints.forZones[0].name"),
        ({"forNodes": [{}]}, "endpoints[0].hints.forNodes[0].name"),
    ],
)
def test_a_wrongly_shaped_hint_is_a_warning_naming_the_field(hints, field):
    e = ep("10.244.1.1")
    e["hints"] = hints
    desired = translate(service(), slice_(endpoints=[e]))
    (warning,) = [w for w in desired.warnings if "malformed" in w]
    assert f"EndpointSlice default/web-abcde: {field}" in warning


ZONED = [
    hinted("10.244.1.1", ("zone-a",), node="node-b"),
    hinted("10.244.2.1", ("zone-b",), node="node-c"),
    hinted("10.244.3.1", ("zone-a",), node="node-d"),
]


def test_zone_hints_from_a_slice_and_the_node_label_filter_the_cluster_endpoints():
    desired = translate(service(), slice_(endpoints=ZONED), zoned_node("zone-a"))
    assert set(desired.state.dests[V("10.96.0.10").key]) == {
        R("10.244.1.1").key,
        R("10.244.3.1").key,
    }
    desired = translate(service(), slice_(endpoints=ZONED), zoned_node("zone-b"))
    assert set(desired.state.dests[V("10.96.0.10").key]) == {R("10.244.2.1").key}


def test_hints_count_across_every_slice_of_the_service():
    """The endpoints of all the Service's slices are one set: one slice without hints
    switches topology off for all of them."""
    other = slice_(name="web-other", endpoints=[ep("10.244.9.1", node="node-e")])
    desired = translate(service(), slice_(endpoints=ZONED), other, zoned_node("zone-a"))
    assert len(desired.state.dests[V("10.96.0.10").key]) == 4


def test_node_hints_come_before_zone_hints():
    eps = [
        hinted("10.244.1.1", ("zone-a",), ("node-a",), node="node-a"),
        hinted("10.244.2.1", ("zone-a",), ("node-b",), node="node-b"),
    ]
    desired = translate(service(), slice_(endpoints=eps), zoned_node("zone-a"))
    assert set(desired.state.dests[V("10.96.0.10").key]) == {R("10.244.1.1").key}


def test_topology_is_applied_before_the_terminating_fallback():
    """Hints look at ready endpoints only; when none is ready, the serving and terminating
    ones are used whatever their hints (kube-proxy: "we would already have chosen to
    ignore topology if there were no ready endpoints")."""
    eps = [
        hinted("10.244.1.1", ("zone-b",), ready=False, serving=True, terminating=True),
        hinted("10.244.2.1", ("zone-a",), ready=False, serving=True, terminating=True),
    ]
    desired = translate(service(), slice_(endpoints=eps), zoned_node("zone-a"))
    assert len(desired.state.dests[V("10.96.0.10").key]) == 2


def test_topology_leaves_local_policy_frontends_alone():
    svc = service(type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local")
    eps = [
        hinted("10.244.1.1", ("zone-b",), node="node-a"),  # local, hinted elsewhere
        hinted("10.244.2.1", ("zone-a",), node="node-b"),
    ]
    desired = translate(svc, slice_(endpoints=eps), zoned_node("zone-a"))
    assert set(desired.state.dests[V("10.96.0.10").key]) == {R("10.244.2.1").key}
    assert set(desired.state.dests[V("192.168.0.10", 30080).key]) == {R("10.244.1.1").key}
