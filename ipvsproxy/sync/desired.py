"""Services + EndpointSlices + this node -> the desired IPVS state (pure).

Owns: the translation with upstream kube-proxy IPVS semantics: a virtual server per Service
port for each ClusterIP, externalIP, LoadBalancer ingress IP and (NodePort/LoadBalancer) node
address; endpoints matched by the Service port's name and protocol in the Service's
EndpointSlices; ready endpoints, else serving-and-terminating ones; topology hints
(`categorize_endpoints`, kube-proxy's CategorizeEndpoints); traffic policies, a Local one
without an endpoint here falling back to the cluster's (counted: `Desired.no_local_endpoints`);
each IP family on its own (nothing of a family the Service has no ClusterIP of); the node's
own addresses never bound; session affinity as IPVS persistence; per-Service schedulers;
a slow-start window (sync/slowstart.py) with its destinations' full weight. Warnings are
returned as data. `explain_service` is the same translation saying why each
endpoint it leaves out is left out (`Reason`, per `Scope`), for `status`: the rules that
filter the endpoints name themselves, there is no second copy of them.

Imports: api, model, schedulers, config, sync.slowstart (its annotation and weight).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ipvsproxy.api import (
    HEADLESS_LABEL,
    PROXY_NAME_LABEL,
    EndpointSliceView,
    EndpointView,
    NodeView,
    ServicePortView,
    ServiceType,
    ServiceView,
)
from ipvsproxy.config import Config
from ipvsproxy.model import (
    IPAddress,
    IPNetwork,
    IpvsState,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
    destinations,
)
from ipvsproxy.policy import Frontend
from ipvsproxy.schedulers import Choice, resolve
from ipvsproxy.sync.slowstart import FULL_WEIGHT, window_of


class TrafficPolicy(enum.StrEnum):
    """The label of kube-proxy's kubeproxy_sync_proxy_rules_no_local_endpoints_total."""

    INTERNAL = "internal"
    EXTERNAL = "external"


# (traffic policy, IP version): a Local policy found no endpoint on this node in that
# family, so the cluster's endpoints are used (kube-proxy PR 97081) and it is counted
NoLocal = tuple[TrafficPolicy, int]


class Reason(enum.StrEnum):
    """Why an endpoint of a Service port is not programmed on this node: the rule of the
    translation that left it out (`status` shows it; docs/status.md)."""

    NOT_READY = "NotReady"  # not ready (nor serving and terminating while none is ready)
    TERMINATING = "Terminating"  # serving and terminating while ready endpoints exist
    OTHER_NODE = "OtherNode"  # a Local traffic policy, and the endpoint is on another node
    TOPOLOGY_ZONE = "TopologyZone"  # its zone hints name other zones than this node's
    TOPOLOGY_NODE = "TopologyNode"  # its node hints name other nodes than this one
    OTHER_FAMILY = "OtherFamily"  # the Service has no ClusterIP of its IP family
    NO_PORT = "NoPort"  # its slice has no port of the Service port's name and protocol


class Scope(enum.StrEnum):
    """The virtual servers of a Service port that one traffic policy governs."""

    INTERNAL = "internal"  # ClusterIPs: internalTrafficPolicy
    EXTERNAL = "external"  # externalIPs, LoadBalancer IPs, node ports: externalTrafficPolicy


class Skipped(enum.StrEnum):
    """Why a whole Service gets no virtual server from ipvsproxy."""

    EXTERNAL_NAME = "ExternalName"
    HEADLESS = "Headless"  # clusterIP: None, or labelled service.kubernetes.io/headless
    OTHER_PROXY = "OtherProxy"  # labelled service.kubernetes.io/service-proxy-name


@dataclass(frozen=True, slots=True)
class Access:
    """A virtual server's kind of address, traffic policy and source ranges."""

    reach: Frontend
    local: bool = False  # externalTrafficPolicy: Local (keep the client's address)
    source_ranges: tuple[IPNetwork, ...] = ()  # loadBalancerSourceRanges


@dataclass(frozen=True, slots=True)
class Desired:
    """The desired state, which Service port caused each virtual server, and warnings."""

    state: IpvsState
    origins: Mapping[VSKey, str] = field(default_factory=dict)  # "ns/name:port"
    warnings: tuple[str, ...] = ()
    access: Mapping[VSKey, Access] = field(default_factory=dict)
    # addresses of the endpoints on this node that serve some virtual server (the hairpin
    # set holds only these: kube-proxy's LOOP-BACK rule)
    local_endpoints: frozenset[IPAddress] = frozenset()
    # Services whose Local traffic policy fell back to the cluster's endpoints, counted per
    # (policy, IP version): kubeproxy_sync_proxy_rules_no_local_endpoints_total
    no_local_endpoints: Mapping[NoLocal, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Entry:
    """One virtual server a Service port asks for, with its destinations."""

    vs: VirtualServer
    dests: Mapping[RSKey, RealServer]
    bind: bool  # the address goes on the dummy device
    origin: str  # "ns/name:port"
    access: Access
    slow_start: float = 0.0  # seconds a new endpoint's weight ramps over (0: off)


@dataclass(frozen=True, slots=True)
class Contribution:
    """Everything one Service asks for (empty for headless, ExternalName, other proxies)."""

    entries: Mapping[VSKey, Entry] = field(default_factory=dict)  # first claim per key wins
    local: frozenset[IPAddress] = frozenset()  # its endpoints on this node
    warnings: tuple[str, ...] = ()
    # the Local traffic policies that found no endpoint on this node although the Service
    # has some elsewhere, per IP version: its frontends use the cluster's endpoints instead
    no_local: frozenset[NoLocal] = frozenset()


@dataclass(frozen=True, slots=True)
class _Frontend:
    address: IPAddress
    port: int
    external: bool  # subject to externalTrafficPolicy (else internalTrafficPolicy)
    bind: bool  # the address goes on the dummy device
    reach: Frontend = Frontend.CLUSTER_IP


# (endpoint, port number) pairs for one Service port
Backend = tuple[EndpointView, int]
Backends = list[Backend]
Left = list[tuple[Backend, Reason]]  # endpoints a rule left out, with the rule


@dataclass(frozen=True, slots=True)
class PortExplanation:
    """One Service port as the translation saw it: every endpoint of the Service (port 0
    where its slice has no port of this one's name and protocol), which of them are left
    out of which virtual servers and why, and the Local policies that found no endpoint here
    and use the cluster's (kube-proxy PR 97081)."""

    origin: str  # "ns/name:port"
    port: ServicePortView
    endpoints: tuple[Backend, ...]
    left: Mapping[Scope, tuple[tuple[Backend, Reason], ...]]  # per scope with virtual servers
    fell_back: frozenset[Scope] = frozenset()


@dataclass(frozen=True, slots=True)
class Explanation:
    """`translate_service` with its reasons (`explain_service`): what the Service asks for,
    why it asks for nothing (`skipped`), and per port why endpoints are left out."""

    contribution: Contribution
    skipped: Skipped | None = None
    ports: tuple[PortExplanation, ...] = ()


def node_warnings(node: NodeView | None, config: Config) -> tuple[str, ...]:
    if node is not None:
        return ()
    return (
        f"Node {config.node_name!r} is not in the input: no NodePort virtual servers "
        "(set --hostname-override to the node's name)",
    )


def translate_service(
    svc: ServiceView,
    slices: Iterable[EndpointSliceView],
    node: NodeView,
    config: Config,
) -> Contribution:
    """What one Service asks of IPVS on this node (pure; kube-proxy's IPVS semantics).

    Each IP family on its own, as kube-proxy's per-family proxiers: a family without a
    ClusterIP of the Service gets nothing (none of its externalIPs, LoadBalancer IPs, node
    ports or endpoints)."""
    return _translate(svc, slices, node, config, None).contribution


def explain_service(
    svc: ServiceView,
    slices: Iterable[EndpointSliceView],
    node: NodeView,
    config: Config,
) -> Explanation:
    """`translate_service`, and why each endpoint left out is (the same code: the rules
    that filter the endpoints name themselves)."""
    return _translate(svc, slices, node, config, [])


def skipped(svc: ServiceView) -> Skipped | None:
    """Why a Service gets no virtual server at all (None: it gets some)."""
    if svc.type is ServiceType.EXTERNAL_NAME:
        return Skipped.EXTERNAL_NAME
    if svc.headless or HEADLESS_LABEL in svc.labels:
        return Skipped.HEADLESS
    if PROXY_NAME_LABEL in svc.labels:
        return Skipped.OTHER_PROXY
    return None


def _translate(
    svc: ServiceView,
    slices: Iterable[EndpointSliceView],
    node: NodeView,
    config: Config,
    why: list[PortExplanation] | None,
) -> Explanation:
    """translate_service(); with `why` (a list), each port's explanation appended to it."""
    reason = skipped(svc)
    if reason is not None:
        return Explanation(Contribution(), reason)
    slices = [s for s in slices if s.address_type != "FQDN"]
    families: set[int] = {ip.version for ip in svc.cluster_ips}
    choice = resolve(svc.annotations, config.scheduler)
    svc, warnings = _refuse_external_ips(svc, config)
    warnings += [f"Service {svc.ref}: {choice.warning}"] if choice.warning else []
    window, warning = window_of(svc.annotations, config.slow_start, choice.scheduler, svc.ref)
    warnings += [warning] if warning else []
    weight = FULL_WEIGHT if window else 1
    entries: dict[VSKey, Entry] = {}
    local: set[IPAddress] = set()
    no_local: set[NoLocal] = set()
    external_local = svc.external_local and _externally_accessible(svc)
    cluster_used, local_used = _uses(svc)
    flags = _flags(choice, svc)
    for port in svc.ports:
        backends = _backends(slices, port)
        local |= {
            ep.address
            for ep, _ in backends
            if ep.node_name == node.name and ep.address.version in families
        }
        origin = f"{svc.ref}:{port.name or port.port}"
        by_family = {
            v: categorize_endpoints(
                [b for b in backends if b[0].address.version == v],
                node,
                cluster_used=cluster_used,
                local_used=local_used,
            )
            for v in families
        }
        left: dict[tuple[Scope, int], Left] = {}
        fell_back: set[Scope] = set()
        for front in _frontends(svc, port, node, config):
            scope = Scope.EXTERNAL if front.external else Scope.INTERNAL
            eps = by_family[front.address.version]
            policy_local = external_local if front.external else svc.internal_local
            usable, excluded = eps.pick(local=policy_local)
            if policy_local and not eps.local and eps.has_any:
                no_local.update(_fell_back(svc, external_local, front.address.version))
                fell_back.add(scope)
            if why is not None:
                left.setdefault((scope, front.address.version), excluded)
            vs = VirtualServer(
                VSKey(front.address, front.port, port.protocol),
                scheduler=choice.scheduler,
                flags=flags,
                timeout_s=svc.affinity_timeout,
            )
            seen = entries.get(vs.key)
            if seen is not None:
                if seen.origin != origin:  # the same Service listing an IP twice is harmless
                    warnings.append(f"Service {origin}: {vs.key} is already used by {seen.origin}")
                continue
            access = Access(
                front.reach,
                local=front.external and svc.external_local,
                source_ranges=svc.source_ranges if front.reach is Frontend.LOAD_BALANCER else (),
            )
            dests = destinations(usable, weight)
            entries[vs.key] = Entry(vs, dests, front.bind, origin, access, window)
        if why is not None:
            why.append(_explain_port(origin, port, slices, backends, families, left, fell_back))
    contribution = Contribution(entries, frozenset(local), tuple(warnings), frozenset(no_local))
    return Explanation(contribution, None, tuple(why or ()))


def _refuse_external_ips(svc: ServiceView, config: Config) -> tuple[ServiceView, list[str]]:
    """The Service without the externalIPs `--external-ip-cidrs` refuses, and a warning
    naming each one. Everything downstream (virtual servers, bound addresses, firewall
    records, `status`) reads the Service returned, so a refused address is nowhere."""
    refused = [ip for ip in svc.external_ips if not config.allows_external_ip(ip)]
    if not refused:
        return svc, []
    kept = tuple(ip for ip in svc.external_ips if config.allows_external_ip(ip))
    warnings = [
        f"Service {svc.ref}: externalIP {ip} is outside --external-ip-cidrs: not programmed"
        for ip in refused
    ]
    return dataclasses.replace(svc, external_ips=kept), warnings


def _explain_port(
    origin: str,
    port: ServicePortView,
    slices: Sequence[EndpointSliceView],
    backends: Backends,
    families: set[int],
    left: Mapping[tuple[Scope, int], Left],
    fell_back: set[Scope],
) -> PortExplanation:
    """One port's explanation: what each scope's chosen set left out (per family), plus the
    endpoints of the other IP family and those whose slice lacks the port (every scope)."""
    family_left: Left = [((ep, n), Reason.OTHER_FAMILY) for ep, n in backends
                         if ep.address.version not in families]  # fmt: skip
    seen = {ep.address for ep, _ in backends}
    portless: Left = []
    for s in slices:
        if _port_number(s, port) is None:
            for ep in s.endpoints:
                if ep.address not in seen:
                    seen.add(ep.address)
                    portless.append(((ep, 0), Reason.NO_PORT))
    by_scope: dict[Scope, Left] = {}
    for (scope, _), excluded in left.items():
        by_scope.setdefault(scope, []).extend(excluded)
    return PortExplanation(
        origin,
        port,
        (*backends, *(b for b, _ in portless)),
        {scope: (*excluded, *family_left, *portless) for scope, excluded in by_scope.items()},
        frozenset(fell_back),
    )


def _fell_back(svc: ServiceView, external_local: bool, version: int) -> Iterable[NoLocal]:
    """What kube-proxy counts when a Local frontend has no endpoint here: every Local
    policy of the Service, whichever frontend found none (its syncEndpoint)."""
    if svc.internal_local:
        yield TrafficPolicy.INTERNAL, version
    if external_local:
        yield TrafficPolicy.EXTERNAL, version


def _externally_accessible(svc: ServiceView) -> bool:
    """kube-proxy's ExternallyAccessible: externalTrafficPolicy counts only for these."""
    return svc.type in (ServiceType.NODE_PORT, ServiceType.LOAD_BALANCER) or bool(svc.external_ips)


def _frontends(
    svc: ServiceView, port: ServicePortView, node: NodeView, config: Config
) -> Iterable[_Frontend]:
    families = {ip.version for ip in svc.cluster_ips}
    for ip in svc.cluster_ips:
        yield _Frontend(ip, port.port, external=False, bind=True)
    # LoadBalancer IPs before externalIPs: an address listed as both is one virtual server,
    # and it must keep the LoadBalancer's source ranges (fail closed; kube-proxy's
    # LOAD-BALANCER-FW matches it whatever else lists it). An address of the node itself is
    # not bound to the dummy device (kube-proxy's shouldBind): it is already the node's, and
    # must not become a VIP whose other ports are rejected.
    for ip in svc.lb_ingress_ips:
        if ip.version in families:
            bind = ip not in node.addresses
            yield _Frontend(ip, port.port, external=True, bind=bind, reach=Frontend.LOAD_BALANCER)
    for ip in svc.external_ips:
        if ip.version in families:
            bind = ip not in node.addresses
            yield _Frontend(ip, port.port, external=True, bind=bind, reach=Frontend.EXTERNAL_IP)
    if port.node_port and svc.type in (ServiceType.NODE_PORT, ServiceType.LOAD_BALANCER):
        for ip in node.primary if config.nodeport_primary else node.addresses:
            if ip.version in families and config.selects_nodeport_address(ip):
                yield _Frontend(
                    ip, port.node_port, external=True, bind=False, reach=Frontend.NODE_PORT
                )


def _flags(choice: Choice, svc: ServiceView) -> ServiceFlags:
    """The IPVS flags of every virtual server of a Service: its scheduler's, and persistence
    for session affinity."""
    flags = ServiceFlags(int(choice.flags))
    if svc.affinity_timeout:
        flags |= ServiceFlags.PERSISTENT
    return flags


def _backends(slices: Sequence[EndpointSliceView], port: ServicePortView) -> Backends:
    """Endpoints for one Service port: slice ports match by the Service port's name+protocol."""
    matched = [(s, number) for s in slices if (number := _port_number(s, port)) is not None]
    if len(matched) == 1:  # one slice (most Services): a duplicate-free one is taken as it is
        ((s, number),) = matched
        unique = {ep.address for ep in s.endpoints}
        if len(unique) == len(s.endpoints):
            return [(ep, number) for ep in s.endpoints]
    found: dict[tuple[IPAddress, int], EndpointView] = {}
    for s, number in matched:
        for ep in s.endpoints:
            key = (ep.address, number)
            seen = found.get(key)
            if seen is None or (ep.ready and not seen.ready):  # a duplicate: prefer ready
                found[key] = ep
    return [(ep, number) for (_, number), ep in found.items()]


def _port_number(s: EndpointSliceView, port: ServicePortView) -> int | None:
    """The number of a slice's port matching the Service port's name and protocol."""
    name, protocol = port.name, port.protocol
    return next((p.port for p in s.ports if p.name == name and p.protocol == protocol), None)


def local_ready_endpoints(
    svc: ServiceView, slices: Sequence[EndpointSliceView], node_name: str
) -> int:
    """kube-proxy's LocalReadyEndpoints for one Service, what its health-check node port
    reports: per Service port, the endpoints on this node that are ready (terminating ones
    are not), summed over the ports."""
    return sum(
        1
        for port in svc.ports
        for ep, _ in _backends(slices, port)
        if ep.ready and ep.node_name == node_name
    )


def _uses(svc: ServiceView) -> tuple[bool, bool]:
    """Whether a Service's frontends ever use the cluster's endpoints, and this node's
    (kube-proxy's ServicePort UsesClusterEndpoints / UsesLocalEndpoints)."""
    external = _externally_accessible(svc)
    return not svc.internal_local or external, svc.internal_local or (
        svc.external_local and external
    )


@dataclass(frozen=True, slots=True)
class Categorized:
    """One family's endpoints of a Service port, as kube-proxy's CategorizeEndpoints
    sorts them, with the endpoints each set leaves out and why."""

    cluster: Backends  # for policy Cluster, topology applied (empty if never used)
    local: Backends  # this node's, for policy Local (empty if never used)
    has_any: bool  # a usable endpoint anywhere in the cluster
    cluster_left: Left = field(default_factory=list)
    local_left: Left = field(default_factory=list)

    def pick(self, *, local: bool) -> tuple[Backends, Left]:
        """The endpoints of a frontend under a Local policy (`local`: this node's, else the
        cluster's: kube-proxy PR 97081, pods here still reach it) or a Cluster one, and
        those left out."""
        if local and (self.local or not self.cluster):
            return self.local, self.local_left
        return self.cluster, self.cluster_left


def categorize_endpoints(
    backends: Backends, node: NodeView, *, cluster_used: bool, local_used: bool
) -> Categorized:
    """kube-proxy's CategorizeEndpoints over one family's endpoints of a Service port:
    ready endpoints (topology hints applied to the cluster set only), else the serving and
    terminating ones, independently for the cluster and the local set."""
    cluster: Backends = []
    cluster_left: Left = []
    if cluster_used:
        cluster, cluster_left = _ready_else_terminating(backends, _topology(backends, node))
    # a cluster set is never empty when any endpoint is usable, and all of its are usable
    has_any = bool(cluster) or any(
        ep.ready or (ep.serving and ep.terminating) for ep, _ in backends
    )
    local: Backends = []
    local_left: Left = []
    if local_used:
        here: Backends = []
        for b in backends:
            if b[0].node_name == node.name:
                here.append(b)
            else:
                local_left.append((b, Reason.OTHER_NODE))
        local, left_here = _ready_else_terminating(here, None)
        local_left += left_here
    return Categorized(cluster, local, has_any, cluster_left, local_left)


Wanted = tuple[Callable[[EndpointView], bool], Reason]  # topology: which, and why not others


def _ready_else_terminating(backends: Backends, wanted: Wanted | None) -> tuple[Backends, Left]:
    """The ready endpoints (those topology `wanted`), else the serving and terminating ones
    (topology never empties the ready set: no ready endpoint anywhere); and the rest, each
    with the rule that left it out."""
    ready: Backends = []
    terminating: Backends = []
    left: Left = []
    for b in backends:
        ep = b[0]
        if ep.ready:
            if wanted is None or wanted[0](ep):
                ready.append(b)
            else:
                left.append((b, wanted[1]))
        elif ep.serving and ep.terminating:
            terminating.append(b)
        else:
            left.append((b, Reason.NOT_READY))
    if ready:
        left += [(b, Reason.TERMINATING) for b in terminating]
        return ready, left
    return terminating, left


def _topology(backends: Backends, node: NodeView) -> Wanted | None:
    """Which ready endpoints this node uses (kube-proxy's topologyModeFromHints): those
    hinted for this node, when every ready endpoint has node hints and one names this node;
    else those hinted for this node's zone, when every ready endpoint has zone hints and one
    names the zone; else all of them (None)."""
    for ep, _ in backends:  # the first ready endpoint without hints settles it (most often)
        if ep.ready:
            if not ep.node_hints and not ep.zone_hints:
                return None
            break
    else:
        return None
    ready = [ep for ep, _ in backends if ep.ready]
    name, zone = node.name, node.zone
    if all(ep.node_hints for ep in ready) and any(name in ep.node_hints for ep in ready):
        return (lambda ep: name in ep.node_hints), Reason.TOPOLOGY_NODE
    if all(ep.zone_hints for ep in ready) and any(zone in ep.zone_hints for ep in ready):
        return (lambda ep: zone in ep.zone_hints), Reason.TOPOLOGY_ZONE
    return None
