"""Frozen views of the Kubernetes objects ipvsproxy reads, parsed from raw JSON.

Owns: `ServiceView`, `ServicePortView`, `EndpointSliceView`, `EndpointView`, `NodeView`, and
`parse_objects()`, which turns raw dicts (from manifests or the API) into views. A malformed
object (bad IP, port out of range, unknown protocol, missing field, duplicate port, or any
field of the wrong JSON type: a string where an object belongs, a number for a list) becomes a
warning that names it and the field; every other object is still parsed. The `parse_*`
functions raise `Malformed` and nothing else, whatever JSON (or YAML: dates, sets) a field
holds; a null field reads as an absent one. Field meanings follow the core/v1 Service and
discovery.k8s.io/v1 EndpointSlice API reference (endpoints' topology hints included).

Imports: model, the standard library. Never the Kubernetes client: raw dicts only.
"""

from __future__ import annotations

import enum
import json
import re
import reprlib
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, ip_address, ip_network
from typing import Any

from ipvsproxy.model import IPAddress, IPNetwork, Proto

RawObject = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RawJson:
    """One object's JSON text, not decoded yet: an item of a JSON manifest's List, whose
    `kind` was read (sync/wire.py decodes the fields ipvsproxy reads straight from it)."""

    kind: str
    data: bytes

    def decoded(self) -> Any:
        """The whole object, as `json.loads` reads it (ValueError, RecursionError)."""
        return json.loads(self.data)


Ref = tuple[str, str]  # (namespace, name) of an object; namespace "" for cluster-scoped ones

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
ZONE_LABEL = "topology.kubernetes.io/zone"  # a Node's zone, matched by endpoints' zone hints
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
    """A field of an API object is invalid or wrongly shaped.

    `field` is the path of the field at fault (`spec.ports[0].port`); the message starts
    with it. The parser raises nothing else for any JSON value in any field it reads
    (tests/test_api_fuzz.py).
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


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
    # spec.healthCheckNodePort of a LoadBalancer with externalTrafficPolicy Local (0: none)
    health_check_node_port: int = 0
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
    # topology hints (discovery/v1 EndpointHints): the zones and nodes this endpoint should
    # serve; empty when the endpoint carries none (kube-proxy's CategorizeEndpoints)
    zone_hints: frozenset[str] = frozenset()
    node_hints: frozenset[str] = frozenset()


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
    # kube-proxy's primary node IPs (GetNodeHostIPs): per family the first InternalIP, else
    # the first ExternalIP (`--nodeport-addresses primary`)
    primary: tuple[IPAddress, ...] = ()
    # kube-proxy's node eligibility for /healthz: not being deleted (metadata
    # .deletionTimestamp) and not tainted ToBeDeletedByClusterAutoscaler
    eligible: bool = True

    @property
    def zone(self) -> str:
        """The node's zone label (kept: under KEPT_META_PREFIXES); "" when unlabelled."""
        return self.labels.get(ZONE_LABEL, "")


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
    name = name if isinstance(name, str) else _shown(name)
    if isinstance(namespace, str) or not namespace:
        return f"{namespace}/{name}" if namespace else name
    return f"{_shown(namespace)}/{name}"


# ---- Service ----------------------------------------------------------------------------


def parse_service(obj: RawObject) -> ServiceView:
    namespace, name, labels, annotations = _meta(obj, namespaced=True)
    spec = _object(obj.get("spec"), "spec", required=True)
    stype = _service_type(spec.get("type"))
    if stype is ServiceType.EXTERNAL_NAME:
        return ServiceView(namespace, name, stype, labels=labels, annotations=annotations)
    cluster_ips = _cluster_ips(spec)
    if cluster_ips is None:
        return ServiceView(namespace, name, stype, headless=True, labels=labels)
    ports = _service_ports(spec.get("ports"))
    balanced = stype is ServiceType.LOAD_BALANCER
    return ServiceView(
        namespace,
        name,
        stype,
        cluster_ips=cluster_ips,
        ports=ports,
        external_ips=tuple(
            _ip(ip, f"spec.externalIPs[{i}]")
            for i, ip in enumerate(_list(spec.get("externalIPs"), "spec.externalIPs"))
        ),
        lb_ingress_ips=_lb_ingress(obj.get("status")) if balanced else (),
        external_local=_policy(spec, "externalTrafficPolicy", ("Cluster", "Global")),
        internal_local=_policy(spec, "internalTrafficPolicy", ("Cluster",)),
        affinity_timeout=_affinity(spec),
        source_ranges=_source_ranges(spec) if balanced else (),
        health_check_node_port=_health_check_port(spec, balanced),
        labels=labels,
        annotations=annotations,
    )


def _health_check_port(spec: RawObject, balanced: bool) -> int:
    """spec.healthCheckNodePort where kube-proxy serves it (NeedsHealthCheck: a
    LoadBalancer with externalTrafficPolicy Local); 0 elsewhere or when unset."""
    value = spec.get("healthCheckNodePort")
    if not balanced or value is None or value == 0:
        return 0
    if not _policy(spec, "externalTrafficPolicy", ("Cluster", "Global")):
        return 0
    return _port(value, "spec.healthCheckNodePort")


def _service_type(value: object) -> ServiceType:
    if value is None:
        return ServiceType.CLUSTER_IP
    text = _str(value, "spec.type")
    try:
        return ServiceType(text)
    except ValueError:
        raise _bad("spec.type", value, f"is not one of {[t.value for t in ServiceType]}") from None


def _source_ranges(spec: RawObject) -> tuple[IPNetwork, ...]:
    ranges = []
    for i, text in enumerate(
        _list(spec.get("loadBalancerSourceRanges"), "spec.loadBalancerSourceRanges")
    ):
        where = f"spec.loadBalancerSourceRanges[{i}]"
        text = _str(text, where)
        try:
            ranges.append(ip_network(text.strip(), strict=False))
        except ValueError:
            raise _bad(where, text, "is not a CIDR") from None
    return tuple(ranges)


def _cluster_ips(spec: RawObject) -> tuple[IPAddress, ...] | None:
    """The Service's cluster IPs, one per family; None for a headless Service."""
    where, ips = "spec.clusterIPs", spec.get("clusterIPs")
    if ips is None or ips == []:  # older objects and hand-written manifests: clusterIP alone
        where, ip = "spec.clusterIP", spec.get("clusterIP")
        if ip is None or ip == "":
            raise Malformed("spec.clusterIP is missing", field=where)
        ips = [_str(ip, where)]
    texts = [_str(ip, f"{where}[{i}]") for i, ip in enumerate(_list(ips, where))]
    if "None" in texts:
        if texts != ["None"]:
            raise Malformed(f"{where} mixes None with addresses", field=where)
        return None
    addresses = tuple(_ip(ip, f"{where}[{i}]") for i, ip in enumerate(texts))
    if len(addresses) > 2 or len({a.version for a in addresses}) != len(addresses):
        raise Malformed(f"{where} {texts} is not one address per family", field=where)
    return addresses


def _service_ports(raw: object) -> tuple[ServicePortView, ...]:
    items = _list(raw, "spec.ports")
    if not items:
        raise Malformed("spec.ports is missing or empty", field="spec.ports")
    ports = []
    for i, item in enumerate(items):
        where = f"spec.ports[{i}]"
        item = _object(item, where, required=True)
        name = _str(_or(item.get("name"), ""), f"{where}.name")
        protocol = _proto(_or(item.get("protocol"), "TCP"), f"{where}.protocol")
        port = _port(item.get("port"), f"{where}.port")
        node_port = item.get("nodePort")  # absent or 0: none allocated (false is no port)
        if node_port is None or (_is_int(node_port) and node_port == 0):
            node_port = 0
        else:
            node_port = _port(node_port, f"{where}.nodePort")
        _target_port(item.get("targetPort"), f"{where}.targetPort")
        ports.append(ServicePortView(name, protocol, port, node_port))
    if len(ports) > 1 and (not all(p.name for p in ports)):
        raise Malformed(
            "spec.ports: every port of a multi-port Service needs a name", field="spec.ports"
        )
    if len({p.name for p in ports}) != len(ports):
        raise Malformed("spec.ports: duplicate port name", field="spec.ports")
    if len({(p.port, p.protocol) for p in ports}) != len(ports):
        raise Malformed("spec.ports: duplicate port and protocol", field="spec.ports")
    return tuple(ports)


def _target_port(value: object, where: str) -> None:
    """A number, a string of ASCII digits (a number), or a port name (core/v1 IntOrString;
    a name as IsValidPortName checks it). Only checked: the endpoints carry the ports."""
    if value is None or value == "":
        return
    if isinstance(value, str):
        if value.isascii() and value.isdigit():
            _port(int(value), where)
        elif not _PORT_NAME.fullmatch(value) or "--" in value or not _LETTER.search(value):
            raise _bad(where, value, "is neither a port number nor a name")
        return
    _port(value, where)


_PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?")
_LETTER = re.compile(r"[a-z]")


def _lb_ingress(raw_status: object) -> tuple[IPAddress, ...]:
    status = _object(raw_status, "status")
    lb = _object(status.get("loadBalancer"), "status.loadBalancer")
    ips = []
    for i, item in enumerate(_list(lb.get("ingress"), "status.loadBalancer.ingress")):
        where = f"status.loadBalancer.ingress[{i}]"
        ingress = _object(item, where, required=True)
        ip = ingress.get("ip")
        mode = _or(ingress.get("ipMode"), "VIP")
        if ip is not None and ip != "" and _str(mode, f"{where}.ipMode") != "Proxy":
            ips.append(_ip(ip, f"{where}.ip"))
    return tuple(ips)


def _policy(spec: RawObject, key: str, cluster_values: Sequence[str]) -> bool:
    value = spec.get(key)
    if value is None or _str(value, f"spec.{key}") in cluster_values:
        return False
    if value == "Local":
        return True
    raise _bad(f"spec.{key}", value, "is neither Cluster nor Local")


def _affinity(spec: RawObject) -> int:
    affinity = _str(_or(spec.get("sessionAffinity"), "None"), "spec.sessionAffinity")
    if affinity in ("None", ""):
        return 0
    if affinity != "ClientIP":
        raise _bad("spec.sessionAffinity", affinity, "is neither None nor ClientIP")
    where = "spec.sessionAffinityConfig"
    config = _object(spec.get("sessionAffinityConfig"), where)
    client = _object(config.get("clientIP"), f"{where}.clientIP")
    where += ".clientIP.timeoutSeconds"
    timeout = _or(client.get("timeoutSeconds"), DEFAULT_AFFINITY_TIMEOUT)
    if not _is_int(timeout) or not 0 < timeout <= MAX_AFFINITY_TIMEOUT:
        raise _bad(where, timeout, f"is not a number of seconds (1-{MAX_AFFINITY_TIMEOUT})")
    return int(timeout)


# ---- EndpointSlice ----------------------------------------------------------------------


def parse_slice(obj: RawObject) -> EndpointSliceView:
    head, version = slice_head(obj)
    if not version:
        return head
    endpoints = tuple(
        _endpoint(item, i, version)
        for i, item in enumerate(_list(obj.get("endpoints"), "endpoints"))
    )
    return with_endpoints(head, endpoints)


def with_endpoints(
    head: EndpointSliceView, endpoints: tuple[EndpointView, ...]
) -> EndpointSliceView:
    return EndpointSliceView(
        head.namespace, head.name, head.service_name, head.address_type, head.ports, endpoints
    )


def slice_head(obj: RawObject) -> tuple[EndpointSliceView, int]:
    """A slice's view without its endpoints, and the IP version its endpoints must have (0:
    an FQDN slice, whose endpoints are not read). sync/wire.py adds endpoints it decoded."""
    namespace, name, labels, _ = _meta(obj, namespaced=True)
    address_type = obj.get("addressType")
    if address_type not in ("IPv4", "IPv6", "FQDN") or not isinstance(address_type, str):
        raise _bad("addressType", address_type, "is not IPv4, IPv6 or FQDN")
    service_name = labels.get(SERVICE_NAME_LABEL, "")
    if address_type == "FQDN":
        return EndpointSliceView(namespace, name, service_name, address_type), 0
    version = 4 if address_type == "IPv4" else 6
    ports = []
    for i, item in enumerate(_list(obj.get("ports"), "ports")):
        where = f"ports[{i}]"
        item = _object(item, where, required=True)
        if item.get("port") is None:  # a nil port means "all ports": unusable for IPVS
            continue
        ports.append(
            EndpointPortView(
                _str(_or(item.get("name"), ""), f"{where}.name"),
                _proto(_or(item.get("protocol"), "TCP"), f"{where}.protocol"),
                _port(item.get("port"), f"{where}.port"),
            )
        )
    return EndpointSliceView(namespace, name, service_name, address_type, tuple(ports)), version


def _endpoint(item: object, i: int, version: int) -> EndpointView:
    """One endpoint: the hot path of parsing (every endpoint of every slice), so the checks
    are inline tests and the field's path is spelled only for an error, which the general
    helpers explain."""
    if type(item) is not dict and not isinstance(item, Mapping):  # dict: not the ABC's check
        raise _wrong(f"endpoints[{i}]", item, "an object")
    addresses = item.get("addresses")
    if not isinstance(addresses, list) or not addresses:
        where = f"endpoints[{i}].addresses"
        if addresses is None or addresses == []:
            raise Malformed(f"{where} is missing", field=where)
        raise _wrong(where, addresses, "a list")
    try:  # consumers use the first address
        address = _ip(addresses[0], "")
    except Malformed:
        address = _ip(addresses[0], f"endpoints[{i}].addresses[0]")  # raises, naming it
    if address.version != version:
        where = f"endpoints[{i}].addresses[0]"
        raise Malformed(f"{where}: {address} is not an IPv{version} address", field=where)
    cond = item.get("conditions")
    if cond is None:
        ready, serving, terminating = True, True, False
    else:
        ready, serving, terminating = _conditions(cond, i)
    node = item.get("nodeName")
    if node is None:
        node = ""
    elif type(node) is not str and not isinstance(node, str):
        raise _wrong(f"endpoints[{i}].nodeName", node, "a string")
    node = sys.intern(node)  # a few node names, 100,000s of endpoints
    hints = item.get("hints")
    if hints is None:
        return EndpointView(address, ready, serving, terminating, node)
    zones, nodes = _hints(hints, f"endpoints[{i}].hints")
    return EndpointView(address, ready, serving, terminating, node, zones, nodes)


def _hints(hints: object, where: str) -> tuple[frozenset[str], frozenset[str]]:
    """(zone names, node names) of an endpoint's `hints.forZones` / `hints.forNodes`."""
    hints = _object(hints, where)
    out = []
    for key in ("forZones", "forNodes"):
        names = []
        for i, item in enumerate(_list(hints.get(key), f"{where}.{key}")):
            at = f"{where}.{key}[{i}]"
            name = _object(item, at, required=True).get("name")
            if name is None or name == "":
                raise Malformed(f"{at}.name is missing", field=f"{at}.name")
            names.append(sys.intern(_str(name, f"{at}.name")))
        out.append(frozenset(names) if names else _NO_HINTS)
    return out[0], out[1]


_NO_HINTS: frozenset[str] = frozenset()


def _conditions(cond: object, i: int) -> tuple[bool, bool, bool]:
    """(ready, serving, terminating) of endpoint `i`; each condition true, false or null."""
    if type(cond) is not dict and not isinstance(cond, Mapping):
        raise _wrong(f"endpoints[{i}].conditions", cond, "an object")
    ready, terminating = cond.get("ready"), cond.get("terminating")
    serving = cond.get("serving", ready)  # absent: as ready (null: unknown)
    for key, value in (("ready", ready), ("serving", serving), ("terminating", terminating)):
        if value is not None and value is not True and value is not False:
            raise _wrong(f"endpoints[{i}].conditions.{key}", value, "true, false or null")
    # discovery/v1: a nil ready or serving condition means "unknown", read as true.
    return ready is not False, serving is not False, terminating is True


# ---- Node -------------------------------------------------------------------------------


def parse_node(obj: RawObject) -> NodeView:
    _, name, labels, _ = _meta(obj, namespaced=False)
    status = _object(obj.get("status"), "status")
    addresses: list[IPAddress] = []
    by_kind: dict[str, list[IPAddress]] = {"InternalIP": [], "ExternalIP": []}
    for i, item in enumerate(_list(status.get("addresses"), "status.addresses")):
        where = f"status.addresses[{i}]"
        item = _object(item, where, required=True)
        kind = _str(_or(item.get("type"), ""), f"{where}.type")
        if kind in ("InternalIP", "ExternalIP"):
            ip = _ip(item.get("address"), f"{where}.address")
            by_kind[kind].append(ip)
            if ip not in addresses:
                addresses.append(ip)
    ranked = (*by_kind["InternalIP"], *by_kind["ExternalIP"])
    primary = [
        next(ip for ip in ranked if ip.version == v)
        for v in (4, 6)
        if any(ip.version == v for ip in ranked)
    ]
    spec = _object(obj.get("spec"), "spec")
    where, cidrs = "spec.podCIDRs", spec.get("podCIDRs")
    if cidrs is None or cidrs == []:
        where, cidr = "spec.podCIDR", spec.get("podCIDR")
        cidrs = [] if cidr is None or cidr == "" else [cidr]
    pod_cidrs = []
    for i, text in enumerate(_list(cidrs, where)):
        at = f"{where}[{i}]" if where == "spec.podCIDRs" else where
        text = _str(text, at)
        try:
            pod_cidrs.append(ip_network(text, strict=False))
        except ValueError:
            raise _bad(at, text, "is not a CIDR") from None
    return NodeView(
        name, tuple(addresses), labels, tuple(pod_cidrs), tuple(primary), _eligible(obj, spec)
    )


TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"  # kube-proxy's ToBeDeletedTaint


def _eligible(obj: RawObject, spec: RawObject) -> bool:
    """kube-proxy's SyncNode: a Node being deleted or tainted for deletion by the cluster
    autoscaler is not eligible (its /healthz answers 503, so load balancers drain it)."""
    meta = _object(obj.get("metadata"), "metadata")
    if meta.get("deletionTimestamp") not in (None, ""):
        return False
    for i, taint in enumerate(_list(spec.get("taints"), "spec.taints")):
        taint = _object(taint, f"spec.taints[{i}]", required=True)
        if _or(taint.get("key"), "") == TO_BE_DELETED_TAINT:
            return False
    return True


# ---- field helpers ----------------------------------------------------------------------
#
# Every value read from an object goes through one of these (or, on the endpoint hot path,
# the same isinstance test inline): a JSON null reads as the field being absent, any other
# value of the wrong type is a Malformed naming the field and the type found.


def _meta(obj: RawObject, *, namespaced: bool) -> tuple[str, str, dict[str, str], dict[str, str]]:
    meta = _object(obj.get("metadata"), "metadata", required=True)
    name = meta.get("name")
    if name is None or name == "":
        raise Malformed("metadata.name is missing", field="metadata.name")
    name = _str(name, "metadata.name")
    namespace = ""
    if namespaced:
        namespace = _str(_or(meta.get("namespace"), ""), "metadata.namespace") or "default"
    labels = _string_map(meta.get("labels"), "metadata.labels")
    annotations = _string_map(meta.get("annotations"), "metadata.annotations")
    return namespace, name, _kept(labels), _kept(annotations)


def _string_map(value: object, where: str) -> Mapping[str, str]:
    values = _object(value, where)
    for key, item in values.items():
        if not isinstance(key, str):
            raise _bad(where, key, "has a key that is not a string")
        if not isinstance(item, str):
            raise _wrong(f"{where}[{key!r}]", item, "a string")
    return values


def _kept(values: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in values.items() if k.startswith(KEPT_META_PREFIXES)}


def _or(value: object, default: object) -> Any:
    """`value`, or `default` when it is null (absent)."""
    return default if value is None else value


def _object(value: object, where: str, *, required: bool = False) -> RawObject:
    """An object; an absent (null) one reads as empty unless `required`."""
    if type(value) is dict or isinstance(value, Mapping):  # dict: not the ABC's slow check
        return value
    if value is None:
        if required:
            raise Malformed(f"{where} is missing", field=where)
        return {}
    raise _wrong(where, value, "an object")


def _list(value: object, where: str) -> list[Any]:
    """A list; an absent (null) one reads as empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _wrong(where, value, "a list")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _wrong(where, value, "a string")
    return value


def _wrong(where: str, value: object, expected: str) -> Malformed:
    return Malformed(f"{where}: expected {expected}, got {_type_name(value)}", field=where)


def _bad(where: str, value: object, problem: str) -> Malformed:
    """`where` holds a value of the right type that is not valid there."""
    return Malformed(f"{where} {_shown(value)} {problem}", field=where)


def _type_name(value: object) -> str:
    """A value's type as JSON names it (as YAML may also give dates, bytes, sets...)."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _shown(value: object) -> str:
    """A value for a message, shortened: an object may carry a whole document, and YAML
    aliases can make a small file a tree of billions of nodes (repr() would never end)."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port(value: object, where: str) -> int:
    if not _is_int(value) or not 1 <= value <= 65535:  # type: ignore[operator]
        raise _bad(where, value, "is not a port number (1-65535)")
    return int(value)  # type: ignore[call-overload, no-any-return]


def _proto(value: object, where: str) -> Proto:
    proto = _PROTOS.get(value) if isinstance(value, str) else None
    if proto is None:
        raise _bad(where, value, "is not TCP, UDP or SCTP")
    return proto


_PROTOS = {p.name: p for p in Proto}


def parse_ip(value: object) -> IPAddress:
    """An IP address as the parsers read one (Malformed naming no field)."""
    return _ip(value, "")


def _ip(value: object, where: str) -> IPAddress:
    if not isinstance(value, str):
        raise _bad(where, value, "is not an IP address")
    try:
        if ":" not in value:
            # inet_pton takes exactly what ipaddress takes for IPv4 (four decimal parts,
            # no leading zeros) and is ~10x faster: every endpoint of every slice passes here
            socket.inet_pton(socket.AF_INET, value)  # the strict IPv4 syntax, as kube-apiserver
            return IPv4Address(value)
        if "%" not in value:  # a scoped IPv6 address (fe80::1%eth0) is no Service address
            return ip_address(value)
    except (OSError, ValueError):  # UnicodeEncodeError (non-ASCII text) is a ValueError
        pass
    raise _bad(where, value, "is not an IP address")
