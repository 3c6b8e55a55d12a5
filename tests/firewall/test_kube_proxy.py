"""kube-proxy's record of its NodePorts (its IPVS mode's KUBE-NODE-PORT-* ipsets), read when a
node moves to ipvsproxy: what it proves, and what it never does."""

from __future__ import annotations

from ipaddress import ip_address

from ipvsproxy import kpcleanup
from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.kube_proxy import NODE_PORT_SETS, adopted, parse_saved, read_adopted
from ipvsproxy.model import Proto, VSKey

NODE = ip_address("192.168.0.10")
OTHER = ip_address("10.0.0.5")  # not a NodePort address of this node

SAVED = """\
create KUBE-NODE-PORT-TCP bitmap:port range 0-65535
add KUBE-NODE-PORT-TCP 30080
create KUBE-NODE-PORT-LOCAL-UDP bitmap:port range 0-65535
add KUBE-NODE-PORT-LOCAL-UDP 30053
create KUBE-NODE-PORT-SCTP-HASH hash:ip,port family inet hashsize 1024 maxelem 65536
add KUBE-NODE-PORT-SCTP-HASH 192.168.0.10,sctp:30132
add KUBE-NODE-PORT-TCP not-a-port
add KUBE-CLUSTER-IP 10.96.0.10,tcp:80
add SOMEONE-ELSES 31000
"""


def test_the_sets_are_read_per_protocol_and_anything_else_proves_nothing():
    assert parse_saved(SAVED) == {
        (Proto.TCP, 30080, None),
        (Proto.UDP, 30053, None),
        (Proto.SCTP, 30132, NODE),
    }


def test_only_node_address_virtual_servers_with_a_listed_protocol_and_port_are_adopted():
    listed = parse_saved(SAVED)
    keys = [
        VSKey(NODE, 30080, Proto.TCP),  # listed
        VSKey(NODE, 30080, Proto.UDP),  # the port, another protocol
        VSKey(OTHER, 30080, Proto.TCP),  # not a node address
        VSKey(NODE, 30081, Proto.TCP),  # in the NodePort range, not listed
        VSKey(NODE, 30053, Proto.UDP),  # listed (Local)
        VSKey(NODE, 30132, Proto.SCTP),  # listed by address and port
        VSKey(ip_address("192.168.0.11"), 30132, Proto.SCTP),  # another address
        VSKey(ip_address("0.0.0.0"), 0, Proto.TCP, 30080),  # a firewall mark: never
    ]
    assert adopted(listed, keys, frozenset({NODE})) == {
        VSKey(NODE, 30080, Proto.TCP),
        VSKey(NODE, 30053, Proto.UDP),
        VSKey(NODE, 30132, Proto.SCTP),
    }


class Ipset:
    def __init__(self, names: str, saved: str = "", fail: bool = False) -> None:
        self.names, self.saved, self.fail = names, saved, fail
        self.ran: list[list[str]] = []

    def run(self, args, *, stdin=None):
        self.ran.append(args)
        if self.fail:
            raise KernelError("ipset: not found")
        return self.names if args[1] == "list" else self.saved


def test_a_node_without_kube_proxy_sets_reads_nothing_more():
    commands = Ipset("IPVSPROXY-CREATED\nKUBE-FIREWALL\n")
    got = read_adopted(commands, [VSKey(NODE, 30080, Proto.TCP)], frozenset({NODE}))  # type: ignore[arg-type]
    assert got == (
        frozenset(),
        "",
    )
    assert commands.ran == [["ipset", "list", "-n"]]  # no save


def test_an_ipset_that_cannot_run_adopts_nothing_and_says_so():
    got, warning = read_adopted(Ipset("", fail=True), [], frozenset({NODE}))  # type: ignore[arg-type]
    assert got == frozenset()
    assert "cannot read kube-proxy's NodePort ipsets" in warning


def test_the_sets_are_kube_proxys_as_cleanup_knows_them():
    assert set(NODE_PORT_SETS) <= kpcleanup.ALL_SETS


def test_the_ipv6_sctp_local_set_is_read_by_kube_proxys_cut_name():
    """kube-proxy cuts KUBE-6-NODE-PORT-LOCAL-SCTP-HASH to the kernel's 31 characters."""
    assert "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS" in NODE_PORT_SETS
    assert all(len(name) <= 31 for name in NODE_PORT_SETS)
    saved = (
        "create KUBE-6-NODE-PORT-LOCAL-SCTP-HAS hash:ip,port family inet6\n"
        "add KUBE-6-NODE-PORT-LOCAL-SCTP-HAS 2001:db8::10,sctp:30132\n"
    )
    assert parse_saved(saved) == {(Proto.SCTP, 30132, ip_address("2001:db8::10"))}
