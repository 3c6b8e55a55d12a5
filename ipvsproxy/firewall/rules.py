"""The constant iptables rules that make IPVS mode work beyond one node (pure).

Owns: `render(version, options)`: ipvsproxy's `IPVSPROXY-*` chains in the nat and filter
tables, as `iptables-save` prints them. IPVS rewrites only the destination; these rules
(kube-proxy's IPVS-mode design: a fixed set of rules matching ipsets, so the rule count does
not grow with Services) add:

  nat  PREROUTING  -> IPVSPROXY-SERVICES   mark for masquerade: ClusterIP traffic from
       OUTPUT      -> IPVSPROXY-OUTPUT     outside the cluster (--detect-local-mode, or
                                           everything with --masquerade-all; without
                                           either, the node's own connections whose
                                           source is a VIP: `src,dst`), externalIP/LB
                                           and NodePort traffic (policy Cluster)
       POSTROUTING -> IPVSPROXY-POSTROUTING  hairpin (LOOP-BACK) and marked traffic
                                           masqueraded, the mark cleared
  filter INPUT     -> IPVSPROXY-FILTER     loadBalancerSourceRanges enforced (DROP); VIP
                                           traffic to a port that is no Service port
                                           rejected (kubernetes#72236)
         FORWARD   -> IPVSPROXY-FORWARD    INVALID dropped; marked packets and
                                           RELATED,ESTABLISHED flows accepted (replies of
                                           IPVS-NAT connections pass FORWARD: on a host
                                           whose FORWARD policy is DROP they would be lost)

The VIP-source rule (kube-proxy's third branch in writeIptablesRules, in KUBE-SERVICES,
which kube-proxy jumps to from PREROUTING and OUTPUT) sits in IPVSPROXY-OUTPUT only: a
packet whose source is a VIP is one this node made (the VIPs are on its dummy device, so
the kernel picks the VIP as the source of a connection to it); from PREROUTING it would
be spoofed.

IPVS sees VIP traffic in LOCAL_IN after the filter table's INPUT chain, so both filters act
before IPVS forwards anything.

Imports: firewall.sets, iptables.transaction (Ruleset), policy, the standard library.
"""

from __future__ import annotations

from ipvsproxy.firewall.sets import (
    CLUSTER_IP,
    EXTERNAL_IP,
    LB_FW,
    LB_SOURCE,
    LOOP_BACK,
    NODE_PORT,
    SERVICE_PORTS,
    VIPS,
    SetSpec,
)
from ipvsproxy.iptables.transaction import Ruleset
from ipvsproxy.policy import LocalMode, NodePolicy, forward_rules

__all__ = [
    "FILTER_JUMPS",
    "NAT_JUMPS",
    "OWNED",
    "PREFIX",
    "LocalMode",
    "NodePolicy",
    "Options",
    "render",
]

PREFIX = "IPVSPROXY-"
SERVICES = "IPVSPROXY-SERVICES"
OUTPUT = "IPVSPROXY-OUTPUT"
POSTROUTING = "IPVSPROXY-POSTROUTING"
MARK_MASQ = "IPVSPROXY-MARK-MASQ"
FILTER = "IPVSPROXY-FILTER"
FORWARD = "IPVSPROXY-FORWARD"

# Ownership is by these exact names, per table, never by prefix: anyone else's IPVSPROXY-X
# is never read, flushed or deleted.
OWNED: dict[str, frozenset[str]] = {
    "nat": frozenset({SERVICES, OUTPUT, POSTROUTING, MARK_MASQ}),
    "filter": frozenset({FILTER, FORWARD}),
}

NAT_JUMPS: tuple[tuple[str, str], ...] = (
    ("PREROUTING", f'-m comment --comment "ipvsproxy ipvs services" -j {SERVICES}'),
    ("OUTPUT", f'-m comment --comment "ipvsproxy ipvs services" -j {OUTPUT}'),
    ("POSTROUTING", f'-m comment --comment "ipvsproxy ipvs postrouting" -j {POSTROUTING}'),
)
FILTER_JUMPS: tuple[tuple[str, str], ...] = (
    ("INPUT", f'-m comment --comment "ipvsproxy ipvs filter" -j {FILTER}'),
    ("FORWARD", f'-m comment --comment "ipvsproxy ipvs forward" -j {FORWARD}'),
)


# The rules' options are the node's policy (ipvsproxy/policy.py), which the iptables
# fallback renders from too.
Options = NodePolicy


def render(version: int, options: Options) -> dict[str, Ruleset]:
    """table ("nat", "filter") -> ipvsproxy's firewall chains for one IP version."""

    def match(spec: SetSpec, dirs: str, *, negate: bool = False) -> str:
        return f"-m set {'! ' if negate else ''}--match-set {spec.name(version)} {dirs}"

    bit = options.bit
    mark = f"-j {MARK_MASQ}"
    cluster = options.cluster_ip_masquerade(version)  # "" = all, None = none
    prerouting, output = [], []
    if cluster is not None:
        prerouting.append(f"-A {SERVICES} {cluster}{match(CLUSTER_IP, 'dst,dst')} {mark}")
        output.append(f"-A {OUTPUT} {match(CLUSTER_IP, 'dst,dst')} {mark}")
    if options.vip_source_masquerade(version):
        output.append(f"-A {OUTPUT} {match(CLUSTER_IP, 'src,dst')} {mark}")
    for chain, rules in ((SERVICES, prerouting), (OUTPUT, output)):
        rules.append(f"-A {chain} {match(EXTERNAL_IP, 'dst,dst')} {mark}")
        rules.append(f"-A {chain} {match(NODE_PORT, 'dst,dst')} {mark}")
    reject = "icmp-port-unreachable" if version == 4 else "icmp6-port-unreachable"
    nat = Ruleset(
        {
            SERVICES: tuple(prerouting),
            OUTPUT: tuple(output),
            MARK_MASQ: (f"-A {MARK_MASQ} -j MARK --set-xmark {options.mark}",),
            POSTROUTING: (
                f"-A {POSTROUTING} {match(LOOP_BACK, 'dst,dst,src')} -j MASQUERADE",
                f"-A {POSTROUTING} -m mark ! --mark {options.mark} -j RETURN",
                f"-A {POSTROUTING} -j MARK --set-xmark 0x0/{bit:#x}",
                f"-A {POSTROUTING} -j MASQUERADE --random-fully",
            ),
        }
    )
    filter_ = Ruleset(
        {
            FILTER: (
                f"-A {FILTER} {match(LB_FW, 'dst,dst')} "
                f"{match(LB_SOURCE, 'dst,dst,src', negate=True)} -j DROP",
                f"-A {FILTER} {match(SERVICE_PORTS, 'dst,dst')} -j RETURN",
                f"-A {FILTER} -m conntrack --ctstate NEW {match(VIPS, 'dst')} "
                f"-j REJECT --reject-with {reject}",
            ),
            FORWARD: forward_rules(FORWARD, options),
        }
    )
    return {"nat": nat, "filter": filter_}
