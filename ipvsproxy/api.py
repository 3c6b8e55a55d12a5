"""Frozen views of the Kubernetes objects ipvsproxy reads, parsed from raw JSON.

Owns: `ServiceView`, `ServicePortView`, `EndpointSliceView`, `EndpointView`, `NodeView`, and
`parse_objects()`, which turns raw dicts (from manifests or the API) into views. A malformed
object (bad IP, port out of range, unknown protocol, missing field, duplicate port) becomes a
warning that names it; every other object is still parsed. Field meanings follow the
core/v1 Service and discovery.k8s.io/v1 EndpointSlice API reference.

Imports: model, the standard library. Never the Kubernetes client: raw dicts only.
"""

from __future__ import annotations

import enum
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, ip_address, ip_network
from typing import Any

from ipvsproxy.model import IPAddress, IPNetwork, Proto

RawObject = Mapping[str, Any]
Ref = tuple[str, str]  # (namespace, name) of an object; namespace "" for cluster-scoped ones

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
# Only labels and annotations under these prefixes are kept in a view: the others (notably
# kubectl's last-applied-configuration, a copy of the whole object) are never read.
KEPT_META_PREFIXES = (
    "ipvsproxy.io/",
    "kubernetes.io/",
    "service.kubernetes.io/",
    "topology.kubernetes.io/",
)
DEFAULT_AFFINITY_TIMEOUT = 10800  # core/v1 ClientIPConfig.timeoutSeconds default
MAX_AFFINITY_TIMEOUT = 86400


class Malformed(ValueError):
    """A field of an API object is invalid; the message names the field."""


class ServiceType(enum.StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"
    EXTERNAL_NAME = "ExternalName"


@dataclass(frozen=True, slots=True)
class ServicePortView:
    name: str
    protocol: Proto
    port: int
    node_port: int = 0  # 0: none allocated


@dataclass(frozen=True, slots=True)
class ServiceView:
    namespace: str
    name: str
    type: ServiceType = ServiceType.CLUSTER_IP
    headless: bool = False
    cluster_ips: tuple[IPAddress, ...] = ()
    ports: tuple[ServicePortView, ...] = ()
    external_ips: tuple[IPAddress, ...] = ()
    lb_ingress_ips: tuple[IPAddress, ...] = ()  # without ipMode: Proxy entries
    external_local: bool = False  # externalTrafficPolicy: Local
    internal_local: bool = False  # internalTrafficPolicy: Local
    affinity_timeout: int = 0  # sessionAffinity ClientIP timeout; 0 = no affinity
    source_ranges: tuple[IPNetwork, ...] = ()  # spec.loadBalancerSourceRanges
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class EndpointView:
    address: IPAddress
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str = ""


@dataclass(frozen=True, slots=True)
class EndpointPortView:
    name: str
    protocol: Proto
    port: int


@dataclass(frozen=True, slots=True)
class EndpointSliceView:
    namespace: str
    name: str
    service_name: str  # "" when the slice has no kubernetes.io/service-name label
    address_type: str  # IPv4, IPv6 or FQDN
    ports: tuple[EndpointPortView, ...] = ()
    endpoints: tuple[EndpointView, ...] = ()

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    addresses: tuple[IPAddress, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    pod_cidrs: tuple[IPNetwork, ...] = ()  # spec.podCIDRs (--detect-local-mode NodeCIDR)


@dataclass(frozen=True, slots=True)
class Parsed:
    services: tuple[ServiceView, ...] = ()
    slices: tuple[EndpointSliceView, ...] = ()
    nodes: tuple[NodeView, ...] = ()
    warnings: tuple[str, ...] = ()


def parse_objects(objects: Iterable[RawObject]) -> Parsed:
    """Parse Services, EndpointSlices and Nodes; other kinds are ignored, bad ones warned."""
    services: list[ServiceView] = []
    slices: list[EndpointSliceView] = []
    nodes: list[NodeView] = []
    warnings: list[str] = []
    for obj in objects:
        kind = obj.get("kind") if isinstance(obj, Mapping) else None
        try:
            if kind == "Service":
                services.append(parse_service(obj))
            elif kind == "EndpointSlice":
                slices.append(parse_slice(obj))
            elif kind == "Node":
                nodes.append(parse_node(obj))
        except Malformed as exc:
            warnings.append(f"skipping malformed {kind} {describe(obj)}: {exc}")
    return Parsed(tuple(services), tuple(slices), tuple(nodes), tuple(warnings))


def describe(obj: object) -> str:
    """namespace/name of a raw object, as far as it can be read."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        return "<no metadata>"
    name, namespace = meta.get("name"), meta.get("namespace")
    return f"{namespace}/{name}" if namespace else str(name)


# ---- Service ----------------------------------------------------------------------------


def parse_service(obj: RawObject) -> ServiceView:
    namespace, name, labels, annotations = _meta(obj, namespaced=True)
    spec = _mapping(obj, "spec")
    stype = _enum(ServiceType, spec.get("type", "ClusterIP"), "spec.type")
    base = ServiceView(namespace, name, stype, labels=labels, annotations=annotations)
    if stype is ServiceType.EXTERNAL_NAME:
        return base
    cluster_ips = _cluster_ips(spec)
    if cluster_ips == ("None",):
        return ServiceView(namespace, name, stype, headless=True, labels=labels)
    ports = _service_ports(spec.get("ports"))
    status = obj.get("status") or {}
    lb = status.get("loadBalancer") or {} if isinstance(status, Mapping) else {}
    return ServiceView(
        namespace,
        name,
        stype,
        cluster_ips=tuple(_ip(ip, "spec.clusterIPs") for ip in cluster_ips),
        ports=ports,
        external_ips=tuple(_ip(ip, "spec.externalIPs") for ip in _list(spec, "externalIPs")),
        lb_ingress_ips=_lb_ingress(lb) if stype is ServiceType.LOAD_BALANCER else (),
        external_local=_policy(spec, "externalTrafficPolicy", ("Cluster", "Global")),
        internal_local=_policy(spec, "internalTrafficPolicy", ("Cluster",)),
        affinity_timeout=_affinity(spec),
        source_ranges=_source_ranges(spec) if stype is ServiceType.LOAD_BALANCER else (),
        labels=labels,
        annotations=annotations,
    )


def _source_ranges(spec: RawObject) -> tuple[IPNetwork, ...]:
    ranges = []
    for i, text in enumerate(_list(spec, "loadBalancerSourceRanges")):
        try:
            ranges.append(ip_network(str(text).strip(), strict=False))
        except ValueError:
            raise Malformed(f"spec.loadBalancerSourceRanges[{i}] {text!r} is not a CIDR") from None
    return tuple(ranges)


def _cluster_ips(spec: RawObject) -> tuple[str, ...]:
    ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    if not isinstance(ips, list) or not ips or not all(isinstance(ip, str) for ip in ips):
        raise Malformed("spec.clusterIP is missing")
    if "None" in ips:
        if ips != ["None"]:
            raise Malformed("spec.clusterIPs mixes None with addresses")
        return ("None",)
    if len(ips) > 2 or len({ip_version(ip) for ip in ips}) != len(ips):
        raise Malformed(f"spec.clusterIPs {ips} is not one address per family")
    return tuple(ips)


def ip_version(text: str) -> int:
    try:
        return ip_address(text).version
    except ValueError:
        raise Malformed(f"invalid IP address {text!r}") from None


def _service_ports(raw: object) -> tuple[ServicePortView, ...]:
    if not isinstance(raw, list) or not raw:
        raise Malformed("spec.ports is missing or empty")
    ports = []
    for i, item in enumerate(raw):
        where = f"spec.ports[{i}]"
        if not isinstance(item, Mapping):
            raise Malformed(f"{where} is not an object")
        name = _str(item.get("name", ""), f"{where}.name")
        protocol = _proto(item.get("protocol", "TCP"), f"{where}.protocol")
        port = _port(item.get("port"), f"{where}.port")
        node_port = item.get("nodePort") or 0
        if node_port:
            node_port = _port(node_port, f"{where}.nodePort")
        _target_port(item.get("targetPort"), f"{where}.targetPort")
        ports.append(ServicePortView(name, protocol, port, node_port))
    if len(ports) > 1 and (not all(p.name for p in ports)):
        raise Malformed("spec.ports: every port of a multi-port Service needs a name")
    if len({p.name for p in ports}) != len(ports):
        raise Malformed("spec.ports: duplicate port name")
    if len({(p.port, p.protocol) for p in ports}) != len(ports):
        raise Malformed("spec.ports: duplicate port and protocol")
    return tuple(ports)


def _target_port(value: object, where: str) -> None:
    if value is None or (isinstance(value, str) and value and not value.isdigit()):
        return
    _port(int(value) if isinstance(value, str) else value, where)


def _lb_ingress(lb: RawObject) -> tuple[IPAddress, ...]:
    ips = []
    for i, ingress in enumerate(lb.get("ingress") or []):
        if not isinstance(ingress, Mapping):
            raise Malformed(f"status.loadBalancer.ingress[{i}] is not an object")
        if ingress.get("ip") and ingress.get("ipMode") != "Proxy":
            ips.append(_ip(ingress["ip"], f"status.loadBalancer.ingress[{i}].ip"))
    return tuple(ips)


def _policy(spec: RawObject, key: str, cluster_values: Sequence[str]) -> bool:
    value = spec.get(key)
    if value is None or value in cluster_values:
        return False
    if value == "Local":
        return True
    raise Malformed(f"spec.{key} {value!r} is neither Cluster nor Local")


def _affinity(spec: RawObject) -> int:
    affinity = spec.get("sessionAffinity") or "None"
    if affinity == "None":
        return 0
    if affinity != "ClientIP":
        raise Malformed(f"spec.sessionAffinity {affinity!r} is neither None nor ClientIP")
    config = (spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}
    timeout = config.get("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT)
    if not _is_int(timeout) or not 0 < timeout <= MAX_AFFINITY_TIMEOUT:
        raise Malformed(f"sessionAffinityConfig.clientIP.timeoutSeconds {timeout!r} out of range")
    return int(timeout)


# ---- EndpointSlice ----------------------------------------------------------------------


def parse_slice(obj: RawObject) -> EndpointSliceView:
    namespace, name, labels, _ = _meta(obj, namespaced=True)
    address_type = obj.get("addressType")
    if address_type not in ("IPv4", "IPv6", "FQDN"):
        raise Malformed(f"addressType {address_type!r} is not IPv4, IPv6 or FQDN")
    service_name = labels.get(SERVICE_NAME_LABEL, "")
    if address_type == "FQDN":
        return EndpointSliceView(namespace, name, service_name, address_type)
    version = 4 if address_type == "IPv4" else 6
    ports = []
    for i, item in enumerate(obj.get("ports") or []):
        where = f"ports[{i}]"
        if not isinstance(item, Mapping):
            raise Malformed(f"{where} is not an object")
        if item.get("port") is None:  # a nil port means "all ports": unusable for IPVS
            continue
        ports.append(
            EndpointPortView(
                _str(item.get("name") or "", f"{where}.name"),
                _proto(item.get("protocol") or "TCP", f"{where}.protocol"),
                _port(item.get("port"), f"{where}.port"),
            )
        )
    endpoints = tuple(
        _endpoint(item, f"endpoints[{i}]", version)
        for i, item in enumerate(obj.get("endpoints") or [])
    )
    return EndpointSliceView(namespace, name, service_name, address_type, tuple(ports), endpoints)


def _endpoint(item: object, where: str, version: int) -> EndpointView:
    if not isinstance(item, Mapping):
        raise Malformed(f"{where} is not an object")
    addresses = item.get("addresses")
    if not isinstance(addresses, list) or not addresses:
        raise Malformed(f"{where}.addresses is missing")
    address = _ip(addresses[0], f"{where}.addresses[0]")  # consumers use the first one
    if address.version != version:
        raise Malformed(f"{where}: {address} is not an IPv{version} address")
    cond = item.get("conditions") or {}
    # discovery/v1: a nil ready or serving condition means "unknown", read as true.
    ready = cond.get("ready") is not False
    serving = cond.get("serving", ready) is not False
    terminating = cond.get("terminating") is True
    node = item.get("nodeName") or ""
    node = sys.intern(_str(node, f"{where}.nodeName"))  # a few node names, 100,000s of endpoints
    return EndpointView(address, ready, serving, terminating, node)


# ---- Node -------------------------------------------------------------------------------


def parse_node(obj: RawObject) -> NodeView:
    _, name, labels, _ = _meta(obj, namespaced=False)
    status = obj.get("status") or {}
    addresses = []
    for i, item in enumerate(status.get("addresses") or []):
        if isinstance(item, Mapping) and item.get("type") in ("InternalIP", "ExternalIP"):
            ip = _ip(item.get("address"), f"status.addresses[{i}].address")
            if ip not in addresses:
                addresses.append(ip)
    spec = obj.get("spec") or {}
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    pod_cidrs = []
    for text in cidrs if isinstance(cidrs, list) else []:
        try:
            pod_cidrs.append(ip_network(str(text), strict=False))
        except ValueError:
            raise Malformed(f"spec.podCIDRs: {text!r} is not a CIDR") from None
    return NodeView(name, tuple(addresses), labels, tuple(pod_cidrs))


# ---- field helpers ----------------------------------------------------------------------


def _meta(obj: RawObject, *, namespaced: bool) -> tuple[str, str, dict[str, str], dict[str, str]]:
    meta = _mapping(obj, "metadata")
    name = meta.get("name")
    namespace = meta.get("namespace") or ("default" if namespaced else "")
    if not isinstance(name, str) or not name:
        raise Malformed("metadata.name is missing")
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    for what, values in (("labels", labels), ("annotations", annotations)):
        if not isinstance(values, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in values.items()
        ):
            raise Malformed(f"metadata.{what} must map strings to strings")
    return str(namespace), name, _kept(labels), _kept(annotations)


def _kept(values: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in values.items() if k.startswith(KEPT_META_PREFIXES)}


def _mapping(obj: RawObject, key: str) -> RawObject:
    value = obj.get(key)
    if not isinstance(value, Mapping):
        raise Malformed(f"{key} is missing")
    return value


def _list(obj: RawObject, key: str) -> list[Any]:
    value = obj.get(key) or []
    if not isinstance(value, list):
        raise Malformed(f"{key} is not a list")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise Malformed(f"{where} is not a string")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port(value: object, where: str) -> int:
    if not _is_int(value) or not 1 <= value <= 65535:  # type: ignore[operator]
        raise Malformed(f"{where} {value!r} is not a port number (1-65535)")
    return int(value)  # type: ignore[call-overload, no-any-return]


def _proto(value: object, where: str) -> Proto:
    try:
        return Proto[value] if isinstance(value, str) else Proto[""]
    except KeyError:
        raise Malformed(f"{where} {value!r} is not TCP, UDP or SCTP") from None


def _ip(value: object, where: str) -> IPAddress:
    if not isinstance(value, str):
        raise Malformed(f"{where} {value!r} is not an IP address")
    try:
        if ":" not in value:
            # inet_pton takes exactly what ipaddress takes for IPv4 (four decimal parts,
            # no leading zeros) and is ~10x faster: every endpoint of every slice passes here
            return IPv4Address(socket.inet_pton(socket.AF_INET, value))
        return ip_address(value)
    except (OSError, ValueError):
        raise Malformed(f"{where} {value!r} is not an IP address") from None


def _enum(cls: type[ServiceType], value: object, where: str) -> ServiceType:
    try:
        return cls(str(value))
    except ValueError:
        raise Malformed(f"{where} {value!r} is not one of {[m.value for m in cls]}") from None
