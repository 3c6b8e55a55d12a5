"""`ipvsproxy cleanup --kube-proxy` on this host's kernel (iptables-nft, ipset; no IPVS), in a
throw-away namespace holding kube-proxy's IPVS-mode layout as kube-proxy names it, beside
kubelet's chains, another owner's chain and set: only kube-proxy's leave."""

from __future__ import annotations

import subprocess

import pytest

from integration.lab import IPVSPROXY

pytestmark = pytest.mark.netns

NAT = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-FROMIPTABLESMODE - [0:0]
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
    dry = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy", "--dry-run")
    assert "would remove: iptables -t nat: chain KUBE-SERVICES" in dry
    assert "would remove: ip6tables -t nat: chain KUBE-SERVICES" in dry
    assert "would remove: iptables -t filter: chain KUBE-IPVS-OUT-FILTER" in dry
    assert "would remove: ipset KUBE-6-CLUSTER-IP" in dry
    assert rules(netns) == before  # a dry run changes nothing

    done = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy")
    assert "removed: iptables -t nat: rule -A PREROUTING" in done
    left = chains(netns)
    kube_proxys = {"KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
                   "KUBE-MARK-MASQ", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL",
                   "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER",
                   "KUBE-IPVS-OUT-FILTER"}  # fmt: skip
    assert not left & kube_proxys
    # kubelet's, iptables mode's (its jump into KUBE-MARK-MASQ went with it) and others' stay
    assert {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-SVC-FROMIPTABLESMODE",
            "OTHER-NAT", "OTHER-FILTER"} <= left  # fmt: skip
    after = rules(netns)
    assert "-A POSTROUTING -s 192.0.2.0/24 -j OTHER-NAT" in after
    assert "-A INPUT -j KUBE-FIREWALL" in after
    assert "-A OUTPUT -j OTHER-FILTER" in after
    assert in_ns(netns, "ipset", "list", "-n").split() == ["other-owner"]
    again = in_ns(netns, IPVSPROXY, "cleanup", "--kube-proxy")
    assert "nothing of kube-proxy's found" in again
