"""Issue 15 items 1 and 3 on the iptables fallback, with real traffic on this host's kernel
inside a throw-away "node" namespace (the root namespace's firewall is never touched).

- node -> ClusterIP with an endpoint behind another link: the backend sees one of the node's
  own addresses, never the VIP. The fallback binds no VIP to any device, so the kernel picks
  the node's address as the source and no rule is needed (kube-proxy's iptables mode has
  none); the test guards that (binding the VIP, as IPVS mode does, makes it fail).
- the node's FORWARD policy DROP (as Docker sets it): kube-proxy's KUBE-FORWARD, rendered by
  `iptables.rules.filter_ruleset()` as IPVSPX-FORWARD, accepts masquerade-marked packets and
  RELATED,ESTABLISHED flows, so a client's connection through a ClusterIP still works.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from ipaddress import ip_network
from typing import Any

import pytest

from integration.lab import PORT, Lab, alive, built, connect, inside, request
from ipvsproxy.config import Config
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.fallback.chains import FILTER_JUMPS, FORWARD, filter_ruleset, owned_filter
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.parse import parse_save
from ipvsproxy.iptables.tools import restore_argv
from ipvsproxy.iptables.transaction import removal, transaction
from ipvsproxy.policy import node_policy
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from tests.factories import ep, node, port, service, slice_

pytestmark = pytest.mark.netns
NODE_NS = "ipvsp-fwd"
NODE_IP = "10.250.1.1"  # the node's address on the client's link
CLUSTER_IP, NODE_PORT = "10.96.0.90", 30090
PROBE = 18081  # a test-owned listener in the backend: it reports the peer address
PODS = Config(
    node_name="node-a",
    cluster_cidrs=(ip_network("10.244.0.0/16"),),  # the client (10.250.1.2) is outside it
    detect_local_mode="ClusterCIDR",
)
# IptablesKernel wires IPVSPX-FORWARD into its observe/apply/cleanup (fallback/backend.py)
WIRED = hasattr(IptablesKernel, "_observe_forward")


def in_node(*argv: str) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", NODE_NS, *argv], capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    # a backend 10.244.1.2 behind the node's link 10.244.1.1/24, a client 10.250.1.2; the
    # node reaches VIPs through its default route to the client's link
    with built(1, node=NODE_NS, tag="fwd", node_routes_to_client=True) as lab:
        yield lab


@pytest.fixture
def drop_policy(lab: Lab) -> Iterator[None]:
    in_node("iptables", "-P", "FORWARD", "DROP")
    try:
        yield
    finally:
        in_node("iptables", "-P", "FORWARD", "ACCEPT")
        commands = Commands(prefix=("ip", "netns", "exec", NODE_NS))
        IptablesKernel(commands=commands).cleanup()


def objects(lab: Lab) -> list[dict[str, Any]]:
    return [
        node(addresses=(NODE_IP,)),
        service(
            "web",
            type="NodePort",
            cluster_ips=(CLUSTER_IP,),
            ports=[port("http", 80, "TCP", PORT, NODE_PORT), port("probe", 81, "TCP", PROBE)],
        ),
        slice_(
            "web",
            ports=(("http", PORT, "TCP"), ("probe", PROBE, "TCP")),
            endpoints=[ep(b.address) for b in lab.backends],
        ),
    ]


def sync(config: Config, objs: list[dict[str, Any]]) -> IptablesKernel:
    """One full pass of the agent's proxier on the fallback inside the node namespace."""
    kernel = IptablesKernel(
        commands=Commands(prefix=("ip", "netns", "exec", NODE_NS)), node=node_policy(config)
    )
    kernel.check()
    proxier = Proxier(kernel=kernel, config=config)
    tracker = Tracker(node_name=config.node_name)
    for kind in (SERVICE, SLICE, NODE):
        tracker.replace(kind, [o for o in objs if o["kind"] == kind])
    result = proxier.sync(tracker.take(), full=True)
    assert result.ok, result.sync.report.failures
    return kernel


def seen_by_backend(lab: Lab, ns: str, address: str, number: int) -> str:
    """The source address of the connection the backend accepts on PROBE."""
    with inside(lab.backends[0].ns):
        listener = socket.create_server(("0.0.0.0", PROBE))
    listener.settimeout(3)
    try:
        with inside(ns):
            client = socket.socket()
        with client:
            client.settimeout(3)
            client.connect((address, number))
            conn, (seen, _) = listener.accept()
            conn.close()
        return str(seen)
    finally:
        listener.close()


def test_the_node_s_connection_to_a_cluster_ip_leaves_from_a_node_address(lab):
    sync(Config(node_name="node-a"), objects(lab))  # kube-proxy's defaults: no detection
    seen = seen_by_backend(lab, NODE_NS, CLUSTER_IP, 81)
    assert seen != CLUSTER_IP
    assert seen in {NODE_IP, "10.244.1.1"}, seen  # the node's own addresses


def install_forward_chain() -> None:
    """IPVSPX-FORWARD as the fallback writes it: the same transaction, in the filter table."""
    saved = parse_save(in_node("iptables-save", "-t", "filter"), table="filter", owns=owned_filter)
    payload = transaction(saved, filter_ruleset(node_policy(PODS)), table="filter",
                          jumps=FILTER_JUMPS)  # fmt: skip
    subprocess.run(
        ["ip", "netns", "exec", NODE_NS, *restore_argv(4)], input=payload, text=True, check=True
    )


def reaches(ns: str, address: str, number: int) -> bool:
    try:
        return bool(request(ns, address, number, timeout=2))
    except OSError:
        return False


def test_the_forward_chain_lets_a_client_through_a_drop_policy(lab, drop_policy):
    client = lab.clients[0]
    sync(PODS, objects(lab))
    if not WIRED:
        assert not reaches(client, CLUSTER_IP, 80)  # DROP bites: the test means something
        install_forward_chain()
    saved = in_node("iptables-save", "-t", "filter")
    assert ":FORWARD DROP" in saved
    assert f"-j {FORWARD}" in saved
    assert request(client, CLUSTER_IP, 80, timeout=3) == "fwdb1"  # marked: outside the pods
    assert request(client, NODE_IP, NODE_PORT, timeout=3) == "fwdb1"  # NodePort: marked
    _, sock = connect(client, CLUSTER_IP, 80, timeout=3)
    with sock:  # the rest of the flow: RELATED,ESTABLISHED, unmarked after the first packet
        assert alive(sock)
        assert alive(sock)
    # the filter rules are ipvsproxy's alone, and cleanup removes the chain and its jump
    chains = parse_save(in_node("iptables-save", "-t", "filter"), table="filter", owns=owned_filter)
    assert set(chains.chains) == {FORWARD}
    assert len(chains.jumps) == 1
    subprocess.run(
        ["ip", "netns", "exec", NODE_NS, *restore_argv(4)],
        input=removal(chains, table="filter"),
        text=True,
        check=True,
    )
    assert FORWARD not in in_node("iptables-save", "-t", "filter")
    assert not reaches(client, CLUSTER_IP, 80)  # without the chain, DROP drops it again


@pytest.mark.xfail(
    not WIRED, strict=True, reason="IptablesKernel does not write IPVSPX-FORWARD yet"
)
def test_the_fallback_itself_writes_repairs_and_cleans_up_its_forward_chain(lab, drop_policy):
    client = lab.clients[0]
    kernel = sync(PODS, objects(lab))
    assert request(client, CLUSTER_IP, 80, timeout=3) == "fwdb1"
    in_node("iptables", "-D", FORWARD, "1")  # damage: the INVALID rule deleted
    assert kernel.observe() is not None
    assert any("filter" in problem for problem in kernel.damage())
    kernel.apply([])
    kernel.observe()
    assert kernel.damage() == ()
    removed = kernel.cleanup()
    assert any("filter: chain IPVSPX-FORWARD" in line for line in removed)
    assert FORWARD not in in_node("iptables-save", "-t", "filter")
