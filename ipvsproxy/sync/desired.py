"""Services + EndpointSlices + this node -> the desired IPVS state (pure).

Owns: the translation with upstream kube-proxy IPVS semantics: a virtual server per Service
port for each ClusterIP, externalIP, LoadBalancer ingress IP and (NodePort/LoadBalancer) node
address; endpoints matched by the Service port's name and protocol in the Service's
EndpointSlices; ready endpoints, else serving-and-terminating ones; traffic policies;
session affinity as IPVS persistence; per-Service schedulers. Warnings are returned as data.

Imports: api, model, schedulers, config.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ipvsproxy import api
from ipvsproxy.api import (
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
)
from ipvsproxy.schedulers import Choice, resolve


class Reach(enum.StrEnum):
    """How traffic reaches a virtual server (what the companion iptables rules need)."""

    CLUSTER_IP = "cluster-ip"
    EXTERNAL_IP = "external-ip"
    LOAD_BALANCER = "load-balancer"
    NODE_PORT = "node-port"


@dataclass(frozen=True, slots=True)
class Access:
    """A virtual server's kind of address, traffic policy and source ranges."""

    reach: Reach
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


@dataclass(frozen=True, slots=True)
class Entry:
    """One virtual server a Service port asks for, with its destinations."""

    vs: VirtualServer
    dests: Mapping[RSKey, RealServer]
    bind: bool  # the address goes on the dummy device
    origin: str  # "ns/name:port"
    access: Access


@dataclass(frozen=True, slots=True)
class Contribution:
    """Everything one Service asks for (empty for headless, ExternalName, other proxies)."""

    entries: Mapping[VSKey, Entry] = field(default_factory=dict)  # first claim per key wins
    local: frozenset[IPAddress] = frozenset()  # its endpoints on this node
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Frontend:
    address: IPAddress
    port: int
    external: bool  # subject to externalTrafficPolicy (else internalTrafficPolicy)
    bind: bool  # the address goes on the dummy device
    reach: Reach = Reach.CLUSTER_IP


# (endpoint, port number) pairs for one Service port
_Backends = list[tuple[EndpointView, int]]


def from_objects(objects: Iterable[api.RawObject], config: Config) -> tuple[Desired, NodeView]:
    """Parse raw API objects and translate them for this node (`config.node_name`)."""
    parsed = api.parse_objects(objects)
    node = next((n for n in parsed.nodes if n.name == config.node_name), None)
    warnings = [*parsed.warnings, *node_warnings(node, config)]
    node = node or NodeView(config.node_name)
    desired = desired_state(parsed.services, parsed.slices, node, config)
    return replace(desired, warnings=(*warnings, *desired.warnings)), node


def node_warnings(node: NodeView | None, config: Config) -> tuple[str, ...]:
    if node is not None:
        return ()
    return (
        f"Node {config.node_name!r} is not in the input: no NodePort virtual servers "
        "(set --hostname-override to the node's name)",
    )


def desired_state(
    services: Iterable[ServiceView],
    slices: Iterable[EndpointSliceView],
    node: NodeView,
    config: Config,
) -> Desired:
    """Translate the API view into IPVS virtual and real servers for this node.

    The same path as the incremental one: every Service through `translate_service()` into a
    `DesiredIndex` (the first Service by namespace/name to claim a key wins).
    """
    from ipvsproxy.sync.index import DesiredIndex

    by_service: dict[tuple[str, str], list[EndpointSliceView]] = defaultdict(list)
    for s in slices:
        if s.service_name:
            by_service[(s.namespace, s.service_name)].append(s)
    index = DesiredIndex()
    for svc in services:
        ref = (svc.namespace, svc.name)
        index.update(ref, translate_service(svc, by_service.get(ref, ()), node, config))
    return index.desired()


def translate_service(
    svc: ServiceView,
    slices: Iterable[EndpointSliceView],
    node: NodeView,
    config: Config,
) -> Contribution:
    """What one Service asks of IPVS on this node (pure; kube-proxy's IPVS semantics)."""
    if svc.type is ServiceType.EXTERNAL_NAME or svc.headless or PROXY_NAME_LABEL in svc.labels:
        return Contribution()
    slices = [s for s in slices if s.address_type != "FQDN"]
    choice = resolve(svc.annotations, config.scheduler)
    warnings = [f"Service {svc.ref}: {choice.warning}"] if choice.warning else []
    entries: dict[VSKey, Entry] = {}
    local: set[IPAddress] = set()
    for port in svc.ports:
        backends = _backends(slices, port)
        local.update(ep.address for ep, _ in backends if ep.node_name == node.name)
        origin = f"{svc.ref}:{port.name or port.port}"
        for front in _frontends(svc, port, node, config):
            vs = _virtual_server(front, port, svc, choice)
            seen = entries.get(vs.key)
            if seen is not None:
                if seen.origin != origin:  # the same Service listing an IP twice is harmless
                    warnings.append(f"Service {origin}: {vs.key} is already used by {seen.origin}")
                continue
            access = Access(
                front.reach,
                local=front.external and svc.external_local,
                source_ranges=svc.source_ranges if front.reach is Reach.LOAD_BALANCER else (),
            )
            rss = _real_servers(backends, front, svc, node.name)
            entries[vs.key] = Entry(vs, {rs.key: rs for rs in rss}, front.bind, origin, access)
    return Contribution(entries, frozenset(local), tuple(warnings))


def _frontends(
    svc: ServiceView, port: ServicePortView, node: NodeView, config: Config
) -> Iterable[_Frontend]:
    for ip in svc.cluster_ips:
        yield _Frontend(ip, port.port, external=False, bind=True)
    # LoadBalancer IPs before externalIPs: an address listed as both is one virtual server,
    # and it must keep the LoadBalancer's source ranges (fail closed; kube-proxy's
    # LOAD-BALANCER-FW matches it whatever else lists it)
    for ip in svc.lb_ingress_ips:
        yield _Frontend(ip, port.port, external=True, bind=True, reach=Reach.LOAD_BALANCER)
    for ip in svc.external_ips:
        yield _Frontend(ip, port.port, external=True, bind=True, reach=Reach.EXTERNAL_IP)
    if port.node_port and svc.type in (ServiceType.NODE_PORT, ServiceType.LOAD_BALANCER):
        for ip in node.addresses:
            if config.selects_nodeport_address(ip):
                yield _Frontend(
                    ip, port.node_port, external=True, bind=False, reach=Reach.NODE_PORT
                )


def _virtual_server(
    front: _Frontend, port: ServicePortView, svc: ServiceView, choice: Choice
) -> VirtualServer:
    flags = ServiceFlags(int(choice.flags))
    if svc.affinity_timeout:
        flags |= ServiceFlags.PERSISTENT
    return VirtualServer(
        VSKey(front.address, front.port, port.protocol),
        scheduler=choice.scheduler,
        flags=flags,
        timeout_s=svc.affinity_timeout,
    )


def _backends(slices: Sequence[EndpointSliceView], port: ServicePortView) -> _Backends:
    """Endpoints for one Service port: slice ports match by the Service port's name+protocol."""
    found: dict[tuple[IPAddress, int], EndpointView] = {}
    for s in slices:
        numbers = [p.port for p in s.ports if p.name == port.name and p.protocol == port.protocol]
        for number in numbers[:1]:
            for ep in s.endpoints:
                seen = found.get((ep.address, number))
                if seen is None or (ep.ready and not seen.ready):  # a duplicate: prefer ready
                    found[(ep.address, number)] = ep
    return [(ep, number) for (_, number), ep in found.items()]


def _real_servers(
    backends: _Backends, front: _Frontend, svc: ServiceView, node_name: str
) -> list[RealServer]:
    local = svc.external_local if front.external else svc.internal_local
    candidates = [
        (ep, n)
        for ep, n in backends
        if ep.address.version == front.address.version and (not local or ep.node_name == node_name)
    ]
    usable = [(ep, n) for ep, n in candidates if ep.ready]
    if not usable:  # upstream: fall back to serving-and-terminating endpoints
        usable = [(ep, n) for ep, n in candidates if ep.serving and ep.terminating]
    return [RealServer(RSKey(ep.address, n)) for ep, n in usable]
