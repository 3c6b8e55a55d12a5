"""`ipvsproxy cleanup --kube-proxy` on this host's kernel (iptables-nft, ipset, nftables; no
IPVS), in throw-away namespaces each holding one of kube-proxy's modes as kube-proxy names
it (IPVS mode's chains and all 34 of its sets, iptables mode's chains and jumps, nftables
mode's two tables: integration/kube_proxy_layout.py), beside kubelet's chains and other
owners' chains, sets and tables: exactly kube-proxy's leave, and `--dry-run` lists exactly
those."""

from __future__ import annotations

import subprocess

import pytest

from integration import kube_proxy_layout as kube_proxy
from integration.lab import IPVSPROXY, inside

pytestmark = pytest.mark.netns

NAT = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-FROMIPTABLESMODE - [0:0]
:KUBE-MARK-DROP - [0:0]
:OTHER-NAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 192.0.2.0/24 -j OTHER-NAT
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT
-A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SVC-FROMIPTABLESMODE -j KUBE-MARK-MASQ
-A OTHER-NAT -j MASQUERADE
COMMIT
"""
FILTER = """*filter
:KUBE-FORWARD - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SOURCE-RANGES-FIREWALL - [0:0]
:KUBE-IPVS-FILTER - [0:0]
:KUBE-IPVS-OUT-FILTER - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:OTHER-FILTER - [0:0]
-A INPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER
-A INPUT -m comment --comment "kube-proxy firewall rules" -j KUBE-PROXY-FIREWALL
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A OUTPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-OUT-FILTER
-A OUTPUT -j OTHER-FILTER
-A KUBE-IPVS-FILTER -m set --match-set KUBE-LOAD-BALANCER dst,dst -j RETURN
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FIREWALL -m conntrack --ctstate INVALID -j DROP
-A OTHER-FILTER -j ACCEPT
COMMIT
"""
SETS = [
    ("KUBE-CLUSTER-IP", "hash:ip,port", "inet"),
    ("KUBE-LOOP-BACK", "hash:ip,port,ip", "inet"),
    ("KUBE-LOAD-BALANCER", "hash:ip,port", "inet"),
    ("KUBE-6-CLUSTER-IP", "hash:ip,port", "inet6"),
    ("KUBE-NODE-PORT-TCP", "bitmap:port", None),
    ("other-owner", "hash:ip", "inet"),
]


def in_ns(ns: str, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, *args], input=stdin, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def layout(ns: str) -> None:
    for name, kind, family in SETS:  # the sets first: the rules match them
        extra = ["family", family] if family else ["range", "0-65535"]
        in_ns(ns, "ipset", "create", name, kind, *extra)
    in_ns(ns, "iptables-restore", "--noflush", stdin=NAT)
    in_ns(ns, "iptables-restore", "--noflush", stdin=FILTER)
    nat6 = NAT.replace("192.0.2.0/24", "2001:db8::/32").replace("KUBE-CLUSTER", "KUBE-6-CLUSTER")
    in_ns(ns, "ip6tables-restore", "--noflush", stdin=nat6)


def rules(ns: str) -> str:
    """Both families' nat and filter rules, without the save's timestamp comments."""
    text = "".join(in_ns(ns, tool, "-t", t) for tool in ("iptables-save", "ip6tables-save")
                   for t in ("nat", "filter"))  # fmt: skip
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def chains(ns: str) -> set[str]:
    return {line.split()[0][1:] for line in rules(ns).splitlines() if line.startswith(":")}


def test_only_kube_proxys_chains_jumps_and_sets_leave(netns: str) -> None:
    layout(netns)
    before = rules(netns)
    sets_before = sorted(in_ns(netns, "ipset", "list", "-n").split())
    dry = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--dry-run")
    assert "would remove: iptables -t nat: chain KUBE-SERVICES" in dry
    assert "would remove: ip6tables -t nat: chain KUBE-SERVICES" in dry
    assert "would remove: iptables -t filter: chain KUBE-IPVS-OUT-FILTER" in dry
    assert "would remove: ipset KUBE-6-CLUSTER-IP" in dry
    assert rules(netns) == before  # a dry run changes nothing
    assert "KUBE-6-CLUSTER-IP" in sets_before
    assert sorted(in_ns(netns, "ipset", "list", "-n").split()) == sets_before  # its sets stay

    done = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--force")  # no agent here
    assert "removed: iptables -t nat: rule -A PREROUTING" in done
    left = chains(netns)
    kube_proxys = {"KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
                   "KUBE-MARK-MASQ", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL",
                   "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER",
                   "KUBE-IPVS-OUT-FILTER"}  # fmt: skip
    assert not left & kube_proxys
    assert "KUBE-SVC-FROMIPTABLESMODE" not in left  # iptables mode's go too
    # kubelet's (and older kubelets' KUBE-MARK-DROP) and others' stay
    assert {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-MARK-DROP", "OTHER-NAT",
            "OTHER-FILTER"} <= left  # fmt: skip
    after = rules(netns)
    assert "-A POSTROUTING -s 192.0.2.0/24 -j OTHER-NAT" in after
    assert "-A INPUT -j KUBE-FIREWALL" in after
    assert "-A OUTPUT -j OTHER-FILTER" in after
    assert in_ns(netns, "ipset", "list", "-n").split() == ["other-owner"]
    again = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--force")  # no agent here
    assert "nothing of kube-proxy's found" in again


# kube-proxy's IPv6 set names (pkg/proxy/ipvs/ipset.go NewIPSet): KUBE- becomes KUBE-6-, cut
# to 31 characters; written out here so that the test does not share the product's rule
V6_CUT = {"KUBE-6-LOAD-BALANCER-SOURCE-CID": "KUBE-LOAD-BALANCER-SOURCE-CIDR",
          "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS": "KUBE-NODE-PORT-LOCAL-SCTP-HASH"}  # fmt: skip


def kube_proxys_sets() -> list[tuple[str, str, str | None]]:
    """All 34: ipsetInfo in both families, as kube-proxy creates them."""
    made = []
    for name, kind in kube_proxy.SETS:
        v6 = "KUBE-6-" + name.removeprefix("KUBE-")
        v6 = next((cut for cut, full in V6_CUT.items() if full == name), v6)
        bitmap = kind == "bitmap:port"
        made += [(name, kind, None if bitmap else "inet"), (v6, kind, None if bitmap else "inet6")]
    return made


def test_every_set_of_both_families_leaves_and_only_those(netns: str) -> None:
    made = kube_proxys_sets()
    assert len(made) == 34
    assert set(V6_CUT) <= {name for name, _, _ in made}
    neighbours = [
        ("KUBE-LOAD-BALANCER-SOURCE-CI", "hash:ip", "inet"),
        ("KUBE-6-OTHER", "hash:ip", "inet6"),
        ("other-owner", "hash:ip", "inet"),
    ]
    for name, kind, family in made + neighbours:  # fmt: skip
        extra = ["family", family] if family else ["range", "0-65535"]
        in_ns(netns, "ipset", "create", name, kind, *extra)
    dry = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--dry-run").splitlines()
    assert sorted(dry[:-1]) == sorted(f"would remove: ipset {name}" for name, _, _ in made)
    assert dry[-1] == "would remove 34 objects"
    in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--force")  # no agent here
    left = sorted(in_ns(netns, "ipset", "list", "-n").split())
    assert left == sorted(name for name, _, _ in neighbours)


def iptables_mode(ns: str) -> None:
    """iptables mode as v1.36 leaves a node, beside kubelet's chains and a CNI's."""
    ports = (kube_proxy.Port("10.96.0.10", 80, ("10.244.1.2:8000", "10.244.2.2:8000")),
             kube_proxy.Port("10.96.0.11", 80, ("10.244.1.2:8000",), node_port=30080,
                             name="default/np:http"))  # fmt: skip
    in_ns(ns, "iptables-restore", "--noflush", stdin=NEIGHBOURS)
    with inside(ns):  # the layout's commands run in the namespace
        kube_proxy.apply("iptables", ports, node_ip="10.250.1.1", cluster_cidr="10.244.0.0/16")


# kubelet's chains (pkg/kubelet/kubelet_network_linux.go) and a CNI plugin's, with jumps
NEIGHBOURS = """*mangle
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*nat
:KUBE-KUBELET-CANARY - [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
COMMIT
*filter
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -j DROP
COMMIT
"""


def dump(ns: str) -> dict[str, set[str]]:
    """Every chain and rule of the three tables, by table, without counters or comments."""
    found: dict[str, set[str]] = {}
    for table in ("mangle", "nat", "filter"):
        text = in_ns(ns, "iptables-save", "-t", table)
        found[table] = {line for line in text.splitlines() if line[:1] in (":", "-")}
    return found


def of(line: str, chains: set[str]) -> bool:
    """Whether a saved line declares one of `chains`, is a rule in one or jumps to one."""
    words = line.split()
    return words[0].lstrip(":") in chains or (words[0] == "-A" and words[1] in chains) or (
        "-j" in words and words[words.index("-j") + 1] in chains)  # fmt: skip


def test_iptables_modes_chains_and_jumps_leave_and_only_those(netns: str) -> None:
    iptables_mode(netns)
    before = dump(netns)
    dry = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--dry-run").splitlines()
    listed = {line.removeprefix("would remove: ") for line in dry[:-1]}
    chains = {item.split(": chain ")[1] for item in listed if ": chain " in item}
    made = {line.split()[0][1:] for t in before.values() for line in t if line[:1] == ":"}
    kube_proxys = {c for c in made if c.startswith(("KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-"))}
    kube_proxys |= {"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
                    "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL",
                    "KUBE-PROXY-CANARY"}  # fmt: skip
    assert chains == kube_proxys
    jumps = {item for item in listed if ": rule -A " in item}
    assert len(jumps) == 12  # iptablesJumpChains; kubelet's KUBE-FIREWALL jumps stay
    # chains: nat 5 fixed + 2 KUBE-SVC + 3 KUBE-SEP + 1 KUBE-EXT, filter 6, mangle 1
    assert len(listed) == len(jumps) + 11 + 6 + 1
    assert dump(netns) == before  # a dry run changes nothing

    in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--force")  # no agent here
    after = dump(netns)
    for table, lines in before.items():
        assert after[table] == {line for line in lines if not of(line, kube_proxys)}, table
    assert "-A INPUT -j KUBE-FIREWALL" in after["filter"]
    assert ":KUBE-IPTABLES-HINT - [0:0]" in after["mangle"]
    again = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--force")  # no agent here
    assert "nothing of kube-proxy's found" in again


# others' nftables tables: firewalld's, one named like kube-proxy's in another family
OTHER_TABLES = """table inet firewalld {
    chain filter_INPUT { type filter hook input priority 10; policy accept; }
}
table inet kube-proxy {
    chain x { type filter hook forward priority 5; policy accept; }
}
table ip other-nat {
    chain pre { type nat hook prerouting priority -90; policy accept; }
}
"""


def tables(ns: str) -> set[str]:
    return set(in_ns(ns, "nft", "list", "tables").splitlines())


def test_nftables_modes_tables_leave_and_only_those(netns: str) -> None:
    ports = (kube_proxy.Port("10.96.0.10", 80, ("10.244.1.2:8000",), node_port=30080),)
    ruleset = kube_proxy.nft_ruleset(ports, node_ip="10.250.1.1", cluster_cidr="10.244.0.0/16")
    in_ns(netns, "nft", "-f", "-", stdin=ruleset + OTHER_TABLES)
    in_ns(netns, "iptables", "-t", "nat", "-N", "OTHER-NAT")  # iptables-nft's table ip nat
    before = tables(netns)
    dry = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--dry-run").splitlines()
    assert dry == [
        "would remove: nft: table ip kube-proxy",
        "would remove: nft: table ip6 kube-proxy",
        "would remove 2 objects",
    ]
    assert tables(netns) == before
    in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--force")  # no agent here
    assert tables(netns) == before - {"table ip kube-proxy", "table ip6 kube-proxy"}
    assert "table inet kube-proxy" in tables(netns)
