"""The node's NAT and filter policy, computed once, rendered by both backends (pure).

Owns: `NodePolicy` (the node settings: --masquerade-bit, --masquerade-all, --cluster-cidr /
--detect-local-mode and its interface), `FrontendPolicy` (what one virtual server needs:
which frontend it is, whether its traffic is masqueraded, its loadBalancerSourceRanges,
whether its VIP rejects other ports) and `frontend_policy()`, the one place that decides them
from a virtual server's access (sync.desired's `Access`, read through `AccessLike`). The IPVS
firewall (firewall/sets.py, firewall/rules.py) and the iptables fallback
(iptables/rules.py) both render from these, so the two backends cannot disagree on who is
masqueraded or who may reach a LoadBalancer. kube-proxy's iptables mode is the reference:

  frontend        masqueraded                                  source ranges  port filter
  ClusterIP       --masquerade-all: all; else traffic not      never          yes
                  from a pod (local detection); without it none
  externalIP      all, unless externalTrafficPolicy: Local      never          yes
  LoadBalancer    all, unless externalTrafficPolicy: Local      enforced       yes
  NodePort        all, unless externalTrafficPolicy: Local      never          no
  (any)           hairpin: an endpoint reaching itself through its Service

Without local detection and without --masquerade-all, the node's own connections to a
ClusterIP (and a hostNetwork pod's) are masqueraded when their source address is a VIP
(`vip_source_masquerade()`, kube-proxy's third branch in the IPVS proxier's
writeIptablesRules: `--match-set KUBE-CLUSTER-IP src,dst`): in IPVS mode every VIP is on
the dummy device, so the kernel picks the VIP itself as the source address, and a backend
on another node would answer a VIP that is local there, losing the reply.

The filter table's forwarding policy (`forward_rules()`, kube-proxy's KUBE-FORWARD, jumped
to from FORWARD): drop conntrack INVALID packets (unless the kernel is liberal about TCP
windows), accept what carries the masquerade mark and every RELATED,ESTABLISHED flow, so
that Service traffic keeps flowing on hosts whose FORWARD policy is DROP (Docker sets it).

Source ranges belong to LoadBalancer ingress frontends only, never to the ClusterIP,
externalIP or NodePort frontends of the same Service (kube-proxy's KUBE-FW- chain hangs off
the LoadBalancer IP alone). A range list with nothing of a frontend's IP family lets no one in
(fail closed), as kube-proxy drops what no range accepts.

Imports: config, model, the standard library.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from ipvsproxy.config import Config
from ipvsproxy.model import IPNetwork


class LocalMode(enum.StrEnum):
    """How to tell pod traffic from the rest (kube-proxy's --detect-local-mode)."""

    NONE = ""  # no detection: ClusterIP traffic is not masqueraded (unless masquerade-all)
    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"
    BRIDGE_INTERFACE = "BridgeInterface"


@dataclass(frozen=True, slots=True)
class NodePolicy:
    """The node-wide settings the NAT rules depend on."""

    masquerade_bit: int = 14  # the mark bit 1 << 14 = 0x4000, as kube-proxy
    masquerade_all: bool = False
    local_mode: LocalMode = LocalMode.NONE
    local_cidrs: tuple[IPNetwork, ...] = ()  # ClusterCIDR / NodeCIDR modes
    interface: str = ""  # the prefix or the bridge (validated by config.parse_interface_name)
    # net.netfilter.nf_conntrack_tcp_be_liberal is set: kube-proxy then drops no INVALID packet
    conntrack_tcp_liberal: bool = False

    @property
    def bit(self) -> int:
        return 1 << self.masquerade_bit

    @property
    def mark(self) -> str:
        """`0x4000/0x4000`: the mark and mask that say "masquerade me"."""
        return f"{self.bit:#x}/{self.bit:#x}"

    def pods(self, version: int) -> tuple[IPNetwork | None, str, bool] | None:
        """What tells pod traffic of one IP family here: (its source CIDR, None, False), or
        (None, the interface, whether it is a name prefix); None when this node cannot tell
        (no detection, or no CIDR of this IP family). Both firewalls render their match
        from it."""
        match self.local_mode:
            case LocalMode.CLUSTER_CIDR | LocalMode.NODE_CIDR:
                nets = [n for n in self.local_cidrs if n.version == version]
                return (nets[0], "", False) if nets else None
            case LocalMode.INTERFACE_NAME_PREFIX | LocalMode.BRIDGE_INTERFACE:
                return None, self.interface, self.local_mode is LocalMode.INTERFACE_NAME_PREFIX
        return None

    def outside(self, version: int) -> str | None:
        """The iptables match for "not from a pod" (with a trailing space), or None when
        this node cannot tell."""
        pods = self.pods(version)
        if pods is None:
            return None
        net, interface, prefix = pods
        return f"! -s {net} " if net is not None else f"! -i {interface}{'+' if prefix else ''} "

    def cluster_ip_masquerade(self, version: int) -> str | None:
        """The match for the ClusterIP traffic to masquerade ("" = all of it), or None."""
        if self.masquerade_all:
            return ""
        return self.outside(version)

    def vip_source_masquerade(self, version: int) -> bool:
        """Whether node traffic whose source address is a ClusterIP (to that Service's
        port) is marked for masquerade: exactly when ClusterIP traffic is not otherwise
        (kube-proxy's IPVS mode, no --masquerade-all and no local detector). Only IPVS mode
        binds VIPs to a device; the iptables fallback binds none, so there the source of
        the node's connections is one of its own addresses and nothing is needed."""
        return self.cluster_ip_masquerade(version) is None


DEFAULT_NODE = NodePolicy()  # no flags: kube-proxy's defaults


def forward_rules(chain: str, node: NodePolicy) -> tuple[str, ...]:
    """The forwarding chain `chain` (kube-proxy's KUBE-FORWARD) as `iptables-save` prints
    it, the same for both IP versions and both backends."""
    rules = [] if node.conntrack_tcp_liberal else [f"-A {chain} {_CT} INVALID -j DROP"]
    return (
        *rules,
        f'-A {chain} -m comment --comment "ipvsproxy forwarding rules" '
        f"-m mark --mark {node.mark} -j ACCEPT",
        f'-A {chain} -m comment --comment "ipvsproxy forwarding conntrack rule" '
        f"{_CT} RELATED,ESTABLISHED -j ACCEPT",
    )


_CT = "-m conntrack --ctstate"


def node_policy(config: Config, pod_cidrs: tuple[IPNetwork, ...] = ()) -> NodePolicy:
    """The flags; for NodeCIDR local detection, the Node's `spec.podCIDRs`."""
    mode = LocalMode(config.detect_local_mode)
    cidrs = pod_cidrs if mode is LocalMode.NODE_CIDR else config.cluster_cidrs
    return NodePolicy(
        masquerade_bit=config.masquerade_bit,
        masquerade_all=config.masquerade_all,
        local_mode=mode,
        local_cidrs=tuple(cidrs),
        interface=config.local_interface,
        conntrack_tcp_liberal=config.conntrack_tcp_be_liberal,
    )


class Frontend(enum.StrEnum):
    """How traffic reaches a virtual server (sync.desired's `Access.reach`)."""

    CLUSTER_IP = "cluster-ip"
    EXTERNAL_IP = "external-ip"
    LOAD_BALANCER = "load-balancer"
    NODE_PORT = "node-port"


class Masquerade(enum.Enum):
    ALWAYS = "always"  # external traffic, externalTrafficPolicy: Cluster
    OUTSIDE = "outside"  # ClusterIP: as NodePolicy.cluster_ip_masquerade() says
    NEVER = "never"  # externalTrafficPolicy: Local keeps the client's address


class AccessLike(Protocol):
    """What `frontend_policy()` reads of sync.desired's `Access` (this module sits below
    the sync layer, so it names the fields, not the class)."""

    @property
    def reach(self) -> Frontend: ...
    @property
    def local(self) -> bool: ...
    @property
    def source_ranges(self) -> tuple[IPNetwork, ...]: ...


@dataclass(frozen=True, slots=True)
class FrontendPolicy:
    """What one virtual server's frontend needs besides its DNAT."""

    frontend: Frontend
    masquerade: Masquerade
    source_ranges: tuple[IPNetwork, ...] = ()  # LoadBalancer only; () = no firewall
    port_filter: bool = True  # a VIP: new connections to its other ports are rejected

    @property
    def firewalled(self) -> bool:
        """Only sources in `source_ranges` may connect (kube-proxy's KUBE-FW- chain)."""
        return bool(self.source_ranges)

    def allowed(self, version: int) -> tuple[IPNetwork, ...]:
        """The ranges of one IP family (none: a firewalled frontend admits no one)."""
        return tuple(net for net in self.source_ranges if net.version == version)


def frontend_policy(access: AccessLike | None, *, bound: bool) -> FrontendPolicy:
    """The policy of one virtual server. Without `access` (a virtual server known only
    from the kernel) it is a ClusterIP when its address is `bound` (a VIP), else a
    NodePort, as the backends have always guessed."""
    ranges: tuple[IPNetwork, ...] = ()
    if access is None:
        frontend = Frontend.CLUSTER_IP if bound else Frontend.NODE_PORT
        local = False
    else:
        frontend = access.reach
        local, ranges = access.local, tuple(access.source_ranges)
    if frontend is Frontend.CLUSTER_IP:
        masquerade = Masquerade.OUTSIDE
    else:
        masquerade = Masquerade.NEVER if local else Masquerade.ALWAYS
    return FrontendPolicy(
        frontend,
        masquerade,
        source_ranges=ranges if frontend is Frontend.LOAD_BALANCER else (),
        port_filter=frontend is not Frontend.NODE_PORT and bound,  # kube-proxy: KUBE-IPVS-IPS
    )
