"""The whole-path benchmark's cluster generator (bench/common.py) translates as it claims."""

from __future__ import annotations

import json
from ipaddress import ip_address, ip_network

from bench.common import (
    API_VIP,
    BENCH_NODE,
    DNS_VIP,
    NODES,
    cluster,
    critical_services,
    expected_counts,
    load_balancer_ip,
    node_ip,
)
from ipvsproxy import manifests
from ipvsproxy.config import Config
from ipvsproxy.model import Proto, VSKey
from ipvsproxy.policy import Frontend
from tests.factories import from_objects


def test_generated_cluster_translates_to_the_expected_counts(tmp_path):
    objects = cluster(200, 10)
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    assert manifests.load([path]) == objects

    desired, node = from_objects(objects, Config(node_name=BENCH_NODE))
    state = desired.state
    assert desired.warnings == ()
    assert node.addresses == (ip_address(node_ip(0)),)
    assert (len(state.services), sum(len(d) for d in state.dests.values())) == expected_counts(
        200, 10
    )
    assert all(len(d) == 10 for d in state.dests.values())
    node_ports = [k for k, a in desired.access.items() if a.reach is Frontend.NODE_PORT]
    assert len(node_ports) == 20
    assert {k.address for k in node_ports} == {ip_address(node_ip(0))}
    cluster_ips = [k for k, a in desired.access.items() if a.reach is Frontend.CLUSTER_IP]
    assert all(k.address in ip_network("10.96.0.0/16") for k in cluster_ips)
    assert {k.proto for k in state.services} == {Proto.TCP}
    # endpoints spread over the nodes, this one included
    assert len(desired.local_endpoints) == 200 * 10 // NODES
    assert all(a in ip_network("10.128.0.0/16") for a in desired.local_endpoints)


def test_the_large_mix_has_load_balancers_slices_of_100_and_the_critical_services():
    """bench/whole_path.py's sizes of issue 37: LoadBalancers (ClusterIP, NodePort, ingress),
    endpoints in slices of at most 100 as the controller writes them, and the API's and
    DNS's Services that `--first-services` puts first."""
    objects = cluster(40, 250, load_balancer_every=20)
    slices = [o for o in objects if o["kind"] == "EndpointSlice"]
    assert len(slices) == 40 * 3
    assert sorted({len(s["endpoints"]) for s in slices}) == [50, 100]
    assert len({s["metadata"]["name"] for s in slices}) == len(slices)
    objects += critical_services(node_ip(0), 6443)
    desired, _ = from_objects(objects, Config(node_name=BENCH_NODE))
    state = desired.state
    assert desired.warnings == ()
    vss, rss = expected_counts(40, 250, load_balancer_every=20)
    assert (len(state.services), sum(len(d) for d in state.dests.values())) == (vss + 4, rss + 7)
    balancers = [k for k, a in desired.access.items() if a.reach is Frontend.LOAD_BALANCER]
    assert {str(k.address) for k in balancers} == {load_balancer_ip(6), load_balancer_ip(26)}
    api = state.dests[VSKey(ip_address(API_VIP), 443, Proto.TCP)]
    assert [(str(rs.address), rs.port) for rs in api] == [(node_ip(0), 6443)]
    assert len(state.dests[VSKey(ip_address(DNS_VIP), 53, Proto.UDP)]) == 2
