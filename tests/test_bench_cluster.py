"""The whole-path benchmark's cluster generator (bench/common.py) translates as it claims."""

from __future__ import annotations

import json
from ipaddress import ip_address, ip_network

from bench.common import BENCH_NODE, NODES, cluster, expected_counts, node_ip
from ipvsproxy import manifests
from ipvsproxy.config import Config
from ipvsproxy.model import Proto
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
