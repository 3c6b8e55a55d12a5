"""Raw Kubernetes objects as the API serves them, for table-driven tests; their translation
from scratch (`from_objects`, `desired_from_manifests`, `desired_state`: every Service into a
fresh `DesiredIndex`, the oracle the incremental path is checked against; the product only
translates incrementally, sync/desired_index.py); the IPVS tables the tests expect (`V`, `R`, `S`,
`state_of`, a web Service's endpoints on this node and the other), and the ownership of the
tests' Service CIDRs (`OWN`).

integration/ and bench/ import it too."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

from ipvsproxy import api, manifests
from ipvsproxy.api import EndpointSliceView, NodeView, ServiceView, read
from ipvsproxy.config import Config, parse_cidrs
from ipvsproxy.model import (
    IPAddress,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
)
from ipvsproxy.schedulers import Scheduler
from ipvsproxy.sync.desired import Desired, node_warnings, translate_service
from ipvsproxy.sync.desired_index import DesiredIndex
from ipvsproxy.sync.ownership import Ownership


def port(name="http", number=80, protocol="TCP", target: Any = 8080, node_port=None):
    p: dict[str, Any] = {"name": name, "port": number, "targetPort": target}
    if protocol is not None:
        p["protocol"] = protocol
    if node_port is not None:
        p["nodePort"] = node_port
    return p


def service(
    name="web",
    *,
    ns="default",
    type="ClusterIP",
    cluster_ips=("10.96.0.10",),
    ports=None,
    annotations=None,
    labels=None,
    status=None,
    **spec: Any,
):
    meta: dict[str, Any] = {"name": name, "namespace": ns}
    if annotations:
        meta["annotations"] = annotations
    if labels:
        meta["labels"] = labels
    body: dict[str, Any] = {"type": type, "ports": [port()] if ports is None else list(ports)}
    if cluster_ips:
        body["clusterIP"] = cluster_ips[0]
        body["clusterIPs"] = list(cluster_ips)
    body.update(spec)
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}
    if status is not None:
        obj["status"] = status
    return obj


def ep(address, *, ready=True, serving=None, terminating=None, node="node-a"):
    cond: dict[str, Any] = {"ready": ready}
    if serving is not None:
        cond["serving"] = serving
    if terminating is not None:
        cond["terminating"] = terminating
    e: dict[str, Any] = {"addresses": [address], "conditions": cond}
    if node:
        e["nodeName"] = node
    return e


def slice_(
    service_name="web",
    *,
    name=None,
    ns="default",
    family="IPv4",
    ports=(("http", 8080, "TCP"),),
    endpoints=(),
    labels=None,
):
    lab = {"kubernetes.io/service-name": service_name} if labels is None else labels
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name or f"{service_name}-abcde", "namespace": ns, "labels": lab},
        "addressType": family,
        "ports": [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports],
        "endpoints": list(endpoints),
    }


def node(name="node-a", addresses=("192.168.0.10",)):
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


# ---- translation from scratch -----------------------------------------------------------


def from_objects(objects: Iterable[api.RawObject], config: Config) -> tuple[Desired, NodeView]:
    """Parse raw API objects and translate them for this node (`config.node_name`)."""
    parsed = api.parse_objects(objects)
    node = next((n for n in parsed.nodes if n.name == config.node_name), None)
    warnings = [*parsed.warnings, *node_warnings(node, config)]
    node = node or NodeView(config.node_name)
    desired = desired_state(parsed.services, parsed.slices, node, config)
    return replace(desired, warnings=(*warnings, *desired.warnings)), node


def desired_from_manifests(paths: Sequence[Path], config: Config) -> tuple[Desired, NodeView]:
    """Parse manifests and translate them for this node."""
    return from_objects(manifests.load(paths), config)


def desired_state(
    services: Iterable[ServiceView],
    slices: Iterable[EndpointSliceView],
    node: NodeView,
    config: Config,
) -> Desired:
    """Translate the API view into IPVS virtual and real servers for this node, from scratch.

    The same path as the incremental one: every Service through `translate_service()` into a
    fresh `DesiredIndex` (the first Service by namespace/name to claim a key wins).
    """
    by_service: dict[tuple[str, str], list[EndpointSliceView]] = defaultdict(list)
    for s in slices:
        if s.service_name:
            by_service[(s.namespace, s.service_name)].append(s)
    index = DesiredIndex()
    for svc in services:
        ref = (svc.namespace, svc.name)
        index.update(ref, translate_service(svc, by_service.get(ref, ()), node, config))
    return index.desired()


def translate(*objects, node_name="node-a", **config: Any) -> Desired:
    if "nodeport_cidrs" in config:
        config["nodeport_cidrs"] = parse_cidrs(config["nodeport_cidrs"], option="test")
    desired, _ = from_objects(list(objects), Config(node_name=node_name, **config))
    return desired


def parse_service(obj: Any) -> ServiceView:
    """The view of a well-formed Service (AssertionError with the warning otherwise)."""
    view = read("Service", obj).view
    assert isinstance(view, ServiceView), read("Service", obj).warning
    return view


def parse_slice(obj: Any) -> EndpointSliceView:
    view = read("EndpointSlice", obj).view
    assert isinstance(view, EndpointSliceView), read("EndpointSlice", obj).warning
    return view


def parse_node(obj: Any) -> NodeView:
    view = read("Node", obj).view
    assert isinstance(view, NodeView), read("Node", obj).warning
    return view


# ---- expected IPVS tables ---------------------------------------------------------------------


def state_of(
    services: Mapping[VirtualServer, list[RealServer]] | None = None,
    bound: frozenset[IPAddress] = frozenset(),
) -> IpvsState:
    """Build a state from virtual servers and their destination lists."""
    services = services or {}
    return IpvsState(
        services={vs.key: vs for vs in services},
        dests={vs.key: {rs.key: rs for rs in rss} for vs, rss in services.items()},
        bound=bound,
    )


def V(addr, number=80, proto="TCP", sched="rr", flags=0, timeout=0) -> VirtualServer:
    key = VSKey(ip_address(addr), number, Proto[proto])
    return VirtualServer(key, Scheduler(sched), ServiceFlags(flags), timeout)


def R(addr, number=8080, weight=1) -> RealServer:
    return RealServer(RSKey(ip_address(addr), number), weight)


def S(services: dict[VirtualServer, list[RealServer]], *bound: str) -> IpvsState:
    return state_of(services, frozenset(ip_address(b) for b in bound))


WEB_SLICE = slice_(endpoints=[ep("10.244.1.1"), ep("10.244.2.1", node="node-b")])
BOTH = [R("10.244.1.1"), R("10.244.2.1")]
LOCAL = [R("10.244.1.1")]

# what ipvsproxy may delete: the tests' Service CIDRs
OWN = Ownership(service_cidrs=(ip_network("10.96.0.0/16"), ip_network("fd00:96::/64")))
