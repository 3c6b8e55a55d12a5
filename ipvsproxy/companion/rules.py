"""The constant iptables rules that make IPVS mode work beyond one node (pure).

Owns: `render(version, options)`: ipvsproxy's `IPVSPROXY-*` chains in the nat and filter
tables, as `iptables-save` prints them. IPVS rewrites only the destination; these rules
(kube-proxy's IPVS-mode design: a fixed set of rules matching ipsets, so the rule count does
not grow with Services) add:

  nat  PREROUTING  -> IPVSPROXY-SERVICES   mark for masquerade: ClusterIP traffic from
       OUTPUT      -> IPVSPROXY-OUTPUT     outside the cluster (--detect-local-mode, or
                                           everything with --masquerade-all), externalIP/LB
                                           and NodePort traffic (policy Cluster)
       POSTROUTING -> IPVSPROXY-POSTROUTING  hairpin (LOOP-BACK) and marked traffic
                                           masqueraded, the mark cleared
  filter INPUT     -> IPVSPROXY-FILTER     loadBalancerSourceRanges enforced (DROP); VIP
                                           traffic to a port that is no Service port
                                           rejected (kubernetes#72236)

IPVS sees VIP traffic in LOCAL_IN after the filter table's INPUT chain, so both filters act
before IPVS forwards anything.

Imports: companion.sets, iptables.rules, model, the standard library.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ipvsproxy.companion.sets import (
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
from ipvsproxy.iptables.rules import Ruleset
from ipvsproxy.model import IPNetwork

PREFIX = "IPVSPROXY-"
SERVICES = "IPVSPROXY-SERVICES"
OUTPUT = "IPVSPROXY-OUTPUT"
POSTROUTING = "IPVSPROXY-POSTROUTING"
MARK_MASQ = "IPVSPROXY-MARK-MASQ"
FILTER = "IPVSPROXY-FILTER"

NAT_JUMPS: tuple[tuple[str, str], ...] = (
    ("PREROUTING", f'-m comment --comment "ipvsproxy ipvs services" -j {SERVICES}'),
    ("OUTPUT", f'-m comment --comment "ipvsproxy ipvs services" -j {OUTPUT}'),
    ("POSTROUTING", f'-m comment --comment "ipvsproxy ipvs postrouting" -j {POSTROUTING}'),
)
FILTER_JUMPS: tuple[tuple[str, str], ...] = (
    ("INPUT", f'-m comment --comment "ipvsproxy ipvs filter" -j {FILTER}'),
)


class LocalMode(enum.StrEnum):
    """How to tell pod traffic from the rest (kube-proxy's --detect-local-mode)."""

    NONE = ""  # no detection: ClusterIP traffic is not masqueraded (unless masquerade-all)
    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"
    BRIDGE_INTERFACE = "BridgeInterface"


@dataclass(frozen=True, slots=True)
class Options:
    """What the rules depend on besides the ipsets."""

    masquerade_bit: int = 14  # the mark bit 1 << 14 = 0x4000, as kube-proxy
    masquerade_all: bool = False
    local_mode: LocalMode = LocalMode.NONE
    local_cidrs: tuple[IPNetwork, ...] = ()  # ClusterCIDR / NodeCIDR modes
    interface: str = ""  # the prefix or the bridge

    @property
    def mark(self) -> str:
        bit = 1 << self.masquerade_bit
        return f"{bit:#x}/{bit:#x}"


def render(version: int, options: Options) -> dict[str, Ruleset]:
    """table ("nat", "filter") -> ipvsproxy's companion chains for one IP version."""

    def match(spec: SetSpec, dirs: str, *, negate: bool = False) -> str:
        return f"-m set {'! ' if negate else ''}--match-set {spec.name(version)} {dirs}"

    bit = 1 << options.masquerade_bit
    mark = f"-j {MARK_MASQ}"
    outside = _outside(version, options)
    prerouting, output = [], []
    if options.masquerade_all:
        prerouting.append(f"-A {SERVICES} {match(CLUSTER_IP, 'dst,dst')} {mark}")
    elif outside is not None:
        prerouting.append(f"-A {SERVICES} {outside}{match(CLUSTER_IP, 'dst,dst')} {mark}")
    if options.masquerade_all or outside is not None:
        output.append(f"-A {OUTPUT} {match(CLUSTER_IP, 'dst,dst')} {mark}")
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
            )
        }
    )
    return {"nat": nat, "filter": filter_}


def _outside(version: int, options: Options) -> str | None:
    """The match for "not from a pod" in PREROUTING (with a trailing space), or None."""
    match options.local_mode:
        case LocalMode.CLUSTER_CIDR | LocalMode.NODE_CIDR:
            nets = [n for n in options.local_cidrs if n.version == version]
            return f"! -s {nets[0]} " if nets else None
        case LocalMode.INTERFACE_NAME_PREFIX:
            return f"! -i {options.interface}+ "
        case LocalMode.BRIDGE_INTERFACE:
            return f"! -i {options.interface} "
    return None
