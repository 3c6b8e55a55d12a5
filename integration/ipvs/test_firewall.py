"""IPVS mode beyond one node: the firewall rules, on the real kernel, in both their
implementations (`--firewall nftables`: one nftables table; `--firewall iptables`: ipsets and
iptables chains): every test runs over each.

Two "nodes" are network namespaces, each with its own IPVS table, dummy device and firewall
(all per namespace), programmed by ipvsproxy's own sync path; pods are namespaces
behind their node; outside clients sit with both nodes on one bridge (192.168.50.0/24).

  client ext1 .100 ─┐                         ┌─ pods 10.244.1.2, .3 (node1)
  client ext2 .200 ─┼─ bridge ─ node1 .1 ─────┘
                    └───────── node2 .2 ─────── pod 10.244.2.2 (node2)
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from integration.lab import (
    LAN,
    PORT,
    Node,
    attach,
    cluster_ip,
    connect,
    endpoints,
    inside,
    objects,
    request,
    sh,
    two_nodes,
)
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.firewall.set_index import SetIndex
from ipvsproxy.firewall.sets import wanted
from tests.factories import from_objects, port, service

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module", params=["nftables", "iptables"])
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Node, Node, list[str]]]:
    pods = (("10.244.1.2", "10.244.1.3"), ("10.244.2.2",))
    with two_nodes(pods, firewall=request.param) as (n1, n2):
        assert n1.firewall.name == request.param
        clients: list[str] = []
        try:
            for i, last in enumerate((100, 200), 1):
                ns = f"ipvsp-ext{i}"
                sh("ip", "netns", "add", ns)
                clients.append(ns)
                attach(ns, f"ext{i}", f"{LAN}.{last}/24")
                for vip in ("203.0.113.10", "10.96.0.0/16"):
                    sh("ip", "-n", ns, "route", "add", vip, "via", n1.address)
            yield n1, n2, clients
        finally:
            for ns in clients:
                subprocess.run(["ip", "netns", "del", ns], check=False)


def nodeport_service(name: str, vip: str, number: int, **spec: Any) -> dict[str, Any]:
    made: dict[str, Any] = service(name, type="NodePort", cluster_ips=(vip,),
                                   ports=[port("p", 80, "TCP", PORT, number)], **spec)  # fmt: skip
    return made


def refused_or_silent(ns: str, address: str, number: int) -> bool:
    try:
        request(ns, address, number, timeout=2)
    except OSError:
        return True
    return False


def test_nodeport_to_a_pod_on_another_node_works_through_snat(cluster):
    n1, n2, (ext1, _) = cluster
    state = objects(
        nodeport_service("np", "10.96.0.30", 30080),
        endpoints("np", ("10.244.2.2", "node-2")),
        nodeport_service("local", "10.96.0.31", 30081, externalTrafficPolicy="Local"),
        endpoints("local", ("10.244.2.2", "node-2")),
    )
    n1.sync(state)
    n2.sync(state)
    # the pod's replies go back through node 1 (it sees node 1 as the source), so this works
    assert request(ext1, n1.address, 30080) == "n2b1"
    # externalTrafficPolicy Local: node 1 has no local endpoint and does not forward
    assert refused_or_silent(ext1, n1.address, 30081)
    assert request(ext1, n2.address, 30081) == "n2b1"


def test_a_pod_reaches_itself_through_its_own_cluster_ip(cluster):
    n1, _, _ = cluster
    n1.sync(objects(cluster_ip("self", "10.96.0.40"), endpoints("self", ("10.244.1.2", "node-1"))))
    pod = n1.lab.backends[0].ns
    assert request(pod, "10.96.0.40", 80) == "n1b1"  # hairpin: masqueraded by LOOP-BACK


def test_only_service_ports_answer_on_a_vip(cluster):
    n1, _, _ = cluster
    n1.sync(objects(cluster_ip("web", "10.96.0.50"), endpoints("web", ("10.244.1.3", "node-1"))))
    with inside(n1.ns):
        host_service = socket.create_server(("0.0.0.0", 2222))
    try:
        pod = n1.lab.backends[0].ns
        assert request(pod, "10.96.0.50", 80) == "n1b2"
        with pytest.raises(ConnectionRefusedError):  # REJECT: not the node's port 2222
            connect(pod, "10.96.0.50", 2222, timeout=3)
        with inside(pod):
            sock = socket.create_connection((n1.address, 2222), timeout=3)  # the node's own port
        sock.close()
    finally:
        host_service.close()


def test_load_balancer_source_ranges(cluster):
    n1, _, (ext1, ext2) = cluster
    lb = service("lb", type="LoadBalancer", cluster_ips=("10.96.0.60",),
                 ports=[port("p", 80, "TCP", PORT, 30090)],
                 loadBalancerSourceRanges=[f"{LAN}.100/32"],
                 status={"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}})  # fmt: skip
    n1.sync(objects(lb, endpoints("lb", ("10.244.1.2", "node-1"))))
    assert request(ext1, "203.0.113.10", 80) == "n1b1"
    assert refused_or_silent(ext2, "203.0.113.10", 80)


def dns_objects(vip: str) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """A UDP Service on node 1's two pods; (Service, objects with both, objects without one)."""
    dns: dict[str, Any] = service("dns", cluster_ips=(vip,), ports=[port("p", 53, "UDP", PORT)])
    pods = {"n1b1": ("10.244.1.2", "node-1"), "n1b2": ("10.244.1.3", "node-1")}
    both = objects(dns, endpoints("dns", *pods.values(), proto="UDP"))

    def without(name: str) -> list[dict[str, Any]]:
        rest = [pod for pod_name, pod in pods.items() if pod_name != name]
        return objects(dns, endpoints("dns", *rest, proto="UDP"))

    return dns, both, without


def test_a_udp_client_moves_on_within_one_sync_after_its_endpoint_goes(cluster):
    n1, _, _ = cluster
    _, both, without = dns_objects("10.96.0.53")
    n1.sync(both)
    client = n1.lab.add_client()
    with inside(client):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1)

    def ask() -> str:
        sock.sendto(b"?", ("10.96.0.53", 53))
        return sock.recv(64).decode()

    first = ask()
    assert {ask() for _ in range(3)} == {first}  # one flow: one backend
    gone = "10.244.1.2" if first == "n1b1" else "10.244.1.3"
    assert _udp_flows(n1.ns, gone)
    n1.sync(without(first))
    assert _udp_flows(n1.ns, gone) == []  # deleted by the sync, not left to time out
    assert ask() != first  # the very next datagram from the same socket
    sock.close()


def test_the_sync_deletes_the_flows_even_where_ipvs_would_keep_them(cluster):
    """IPVS itself drops connections to deleted destinations since Linux 5.9, and only with
    expire_nodest_conn=1: with it off here (as on older kernels) the flows stay unless the
    sync deletes them."""
    n1, _, _ = cluster
    _, both, without = dns_objects("10.96.0.57")
    n1.sync(both)
    sh("ip", "netns", "exec", n1.ns, "sysctl", "-qw", "net.ipv4.vs.expire_nodest_conn=0")
    try:
        client = n1.lab.add_client()
        with inside(client):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with sock:
            sock.settimeout(1)
            sock.sendto(b"?", ("10.96.0.57", 53))
            first = sock.recv(64).decode()
        gone = "10.244.1.2" if first == "n1b1" else "10.244.1.3"
        assert _udp_flows(n1.ns, gone)
        n1.sync(without(first))
        assert _udp_flows(n1.ns, gone) == []
    finally:
        sh("ip", "netns", "exec", n1.ns, "sysctl", "-qw", "net.ipv4.vs.expire_nodest_conn=1")


def _udp_flows(ns: str, reply_source: str) -> list[str]:
    listed = subprocess.run(
        ["ip", "netns", "exec", ns, "conntrack", "-L", "-p", "udp", "--reply-src", reply_source],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line for line in listed.splitlines() if line.strip()]


def _rules(node: Node) -> int:
    """ipvsproxy's rules on the node, as the firewall's own tool lists them."""
    if node.firewall.name == "nftables":
        listed = json.loads(_in(node.ns, "nft", "-j", "list", "table", "inet", "ipvsproxy"))
        return sum(1 for item in listed["nftables"] if "rule" in item)
    text = ""
    for table in ("nat", "filter"):
        text += _in(node.ns, "iptables-save", "-t", table)
    return sum(1 for line in text.splitlines() if line.startswith("-A") and "IPVSPROXY" in line)


def _set(node: Node, name: str) -> set[str]:
    """A set's entries, read with the firewall's own tool, spelt as `ipset save` prints them."""
    if node.firewall.name == "iptables":
        saved = _in(node.ns, "ipset", "save", name)
        return {line.split()[2] for line in saved.splitlines() if line.startswith("add ")}
    nft_name = name.removeprefix("IPVSPROXY-").lower()
    listed = json.loads(_in(node.ns, "nft", "-j", "list", "set", "inet", "ipvsproxy", nft_name))
    (found,) = [item["set"] for item in listed["nftables"] if "set" in item]
    out = set()
    for elem in found.get("elem", ()):
        if isinstance(elem, str):  # a hash:ip set's address
            out.add(elem)
            continue
        address, proto, number, *rest = elem["concat"]
        nets = [f"{r['prefix']['addr']}/{r['prefix']['len']}" if isinstance(r, dict) else r
                for r in rest]  # fmt: skip
        out.add(",".join([address, f"{proto}:{number}", *nets]))
    return out


def _in(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *args],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip


def many(count: int) -> list[dict[str, Any]]:
    """`count` ClusterIP Services, each with one endpoint on node 1 and one on node 2."""
    out = []
    for i in range(count):
        vip = f"10.97.{i // 250}.{i % 250 + 1}"
        pods = (f"10.244.1.{i % 2 + 2}", "node-1"), (f"10.244.2.{i % 250 + 2}", "node-2")
        out += [cluster_ip(f"s{i}", vip), endpoints(f"s{i}", *pods)]
    return objects(*out)


def test_1000_services_every_firewall_step_succeeds_and_the_rule_count_stays(cluster):
    n1, _, _ = cluster
    started = time.monotonic()
    n1.sync(many(10))
    ten = _rules(n1)
    assert ten > 10
    steps = {"10": n1.firewall_s}
    n1.sync(many(1000))  # every step asserted to succeed inside sync()
    steps["1000"] = n1.firewall_s
    assert _rules(n1) == ten
    assert "10.97.3.250,tcp:80" in _set(n1, "IPVSPROXY-CLUSTER-IP")
    assert len(_set(n1, "IPVSPROXY-CLUSTER-IP")) == 1000
    # hairpin entries for node 1's own pods only, none for the 250 pods on node 2
    assert _set(n1, "IPVSPROXY-LOOP-BACK") == {
        f"10.244.1.{n},tcp:{PORT},10.244.1.{n}" for n in (2, 3)
    }
    n1.sync(many(1000))
    steps["again"] = n1.firewall_s
    n1.sync(objects())
    steps["none"] = n1.firewall_s
    assert _set(n1, "IPVSPROXY-CLUSTER-IP") == set()
    # a step that timed out (ipset restore's 60 s, before) fails its pass: `sync` checks that
    print(f"firewall steps (s): {steps}; whole test {time.monotonic() - started:.1f} s")


def test_the_incremental_set_index_writes_what_the_full_path_wants(cluster):
    """Between full syncs: seed from the host, update per virtual server, one restore."""
    n1, _, _ = cluster
    n1.sync(many(20))
    desired, _ = from_objects(many(20), n1.config)
    index = SetIndex(versions=n1.firewall.versions)
    index.reset(desired.state, desired.access, local=desired.local_endpoints)
    observed = n1.firewall.observe_sets()  # iptables: over netlink; nftables: nft -j
    iptables = n1.firewall.name == "iptables"
    if iptables:
        tool = Firewall(commands=n1.firewall.commands, versions=n1.firewall.versions)
        assert tool.observe_sets() == observed  # ipset save says the same
    index.seed(observed)
    assert index.take() == ()  # the full sync left exactly what the index wants
    changed, _ = from_objects(many(300), n1.config)  # 280 more: swapped in
    fewer, _ = from_objects(many(5), n1.config)
    for target in (changed, fewer):
        keys = set(target.state.services) | index.keys()
        index.update_from(keys, target.state, target.access, local=target.local_endpoints)
        n1.firewall.write_sets(index.take())
        host = n1.firewall.observe_sets()
        want = wanted(target.state, target.access, local=target.local_endpoints)
        for name, (_, version, entries) in want.sets.items():
            if version in n1.firewall.versions:
                assert host.sets[name][2] == entries, name
                assert _set(n1, name) == entries, name  # as the tool itself reads it
        if iptables:
            assert isinstance(n1.firewall, Firewall)
            assert index.drifted(n1.firewall.observe_headers()) == ()
    if iptables:
        assert isinstance(n1.firewall, Firewall)
        sh("ip", "netns", "exec", n1.ns, "ipset", "del", "IPVSPROXY-CLUSTER-IP", "10.97.0.1,tcp:80")
        assert index.drifted(n1.firewall.observe_headers()) == ("IPVSPROXY-CLUSTER-IP",)
    n1.sync(objects())
