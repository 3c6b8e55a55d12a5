"""Issue 15 items 1 and 3 under real IPVS: the firewall's rules in the two-node lab
(lab.two_nodes(), as test_firewall.py: nodes are namespaces on one bridge, pods behind
them), with kube-proxy's default settings: no --cluster-cidr, no --masquerade-all; over
both implementations of the firewall (nftables, iptables).

- node -> ClusterIP whose only endpoint is on the other node: the VIP is on node 1's dummy
  device, so the kernel picks it as the source; without the `src,dst` masquerade rule the
  backend would see (and answer) the VIP, which node 2 holds too. It must see node 1.
- node 1's FORWARD policy DROP (as Docker sets it): a pod's connection through a ClusterIP
  to a pod on node 2 still works (IPVS sends the request from LOCAL_OUT, but the reply is
  forwarded to the pod: IPVSPROXY-FORWARD accepts it as ESTABLISHED). iptables only: an
  accept in ipvsproxy's nftables table cannot overrule iptables' DROP, so `--firewall auto`
  keeps iptables on such a node (integration/netns/test_nft_firewall.py, docs/firewall.md).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from ipaddress import ip_network
from typing import Any

import pytest

from integration.lab import (
    LAN,
    Node,
    cluster_ip,
    endpoints,
    inside,
    objects,
    request,
    sh,
    two_nodes,
)
from ipvsproxy.config import Config
from tests.factories import ep, port, service, slice_

pytestmark = pytest.mark.vm

PROBE = 18080  # a test-owned listener in node 2's pod: it reports the peer address


@pytest.fixture(scope="module", params=["nftables", "iptables"])
def lab(request: pytest.FixtureRequest) -> Iterator[tuple[Node, Node]]:
    def kube_proxys_defaults(n: Node) -> None:  # no local detection, no --masquerade-all
        n.config = Config(node_name=n.name, nodeport_cidrs=(ip_network(f"{LAN}.0/24"),),
                          firewall=request.param)  # fmt: skip

    pods = (("10.244.1.2",), ("10.244.2.2",))
    with two_nodes(pods, configure=kube_proxys_defaults, firewall=request.param) as nodes:
        assert nodes[0].firewall.name == request.param
        yield nodes


def probe_objects(vip: str) -> list[dict[str, Any]]:
    probe = service("probe", cluster_ips=(vip,), ports=[port("p", 81, "TCP", PROBE)])
    slice_probe = slice_(
        "probe", ports=(("p", PROBE, "TCP"),), endpoints=[ep("10.244.2.2", node="node-2")]
    )
    return objects(probe, slice_probe)


def test_the_node_s_connection_to_a_cluster_ip_reaches_a_remote_backend_from_its_address(lab):
    n1, n2 = lab
    vip = "10.96.0.81"
    state = probe_objects(vip)
    n1.sync(state)
    n2.sync(state)  # node 2 holds the VIP too: a reply to it would stay there
    with inside(n2.lab.backends[0].ns):
        listener = socket.create_server(("0.0.0.0", PROBE))
    listener.settimeout(5)
    try:
        with inside(n1.ns):
            client = socket.socket()
        with client:
            client.settimeout(5)
            client.connect((vip, 81))  # from the node itself (a hostNetwork pod alike)
            conn, (seen, _) = listener.accept()
            conn.close()
    finally:
        listener.close()
    assert seen == n1.address, f"the backend saw {seen}, not node 1 ({n1.address})"


@pytest.mark.parametrize("lab", ["iptables"], indirect=True)  # see the module's docstring
def test_a_pod_s_connection_through_a_cluster_ip_survives_forward_policy_drop(lab):
    n1, n2 = lab
    state = objects(cluster_ip("far", "10.96.0.82"), endpoints("far", ("10.244.2.2", "node-2")))
    n1.sync(state)
    n2.sync(state)
    pod = n1.lab.backends[0].ns
    sh("ip", "netns", "exec", n1.ns, "iptables", "-P", "FORWARD", "DROP")
    try:
        assert request(pod, "10.96.0.82", 80, timeout=10) == "n2b1"
        saved = subprocess.run(
            ["ip", "netns", "exec", n1.ns, "iptables-save", "-t", "filter"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert ":FORWARD DROP" in saved  # the policy really was DROP meanwhile
    finally:
        sh("ip", "netns", "exec", n1.ns, "iptables", "-P", "FORWARD", "ACCEPT")
