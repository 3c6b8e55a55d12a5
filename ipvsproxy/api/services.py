"""A decoded Service (api/schema.py) to its `ServiceView`, checking what its fields mean.

Imports: api.views, api.schema, api.values, model, the standard library.
"""

from __future__ import annotations

import re
from typing import TypeVar

from ipvsproxy.api import schema
from ipvsproxy.api.values import Malformed, bad, cidr, ip, kept, missing, port, proto
from ipvsproxy.api.views import (
    DEFAULT_AFFINITY_TIMEOUT,
    MAX_AFFINITY_TIMEOUT,
    ServicePortView,
    ServiceType,
    ServiceView,
)
from ipvsproxy.model import IPAddress, IPNetwork

M = TypeVar("M", bound=schema.Meta)


def service_view(raw: schema.Service) -> ServiceView:
    namespace, name, meta = names(raw.metadata, namespaced=True)
    labels, annotations = kept(meta.labels), kept(meta.annotations)
    spec = raw.spec
    if spec is None:
        raise missing("spec")
    stype = _service_type(spec.type)
    if stype is ServiceType.EXTERNAL_NAME:
        return ServiceView(namespace, name, stype, labels=labels, annotations=annotations)
    cluster_ips = _cluster_ips(spec)
    if cluster_ips is None:
        return ServiceView(namespace, name, stype, headless=True, labels=labels)
    ports = _service_ports(spec.ports)
    balanced = stype is ServiceType.LOAD_BALANCER
    external_local = _policy(spec.external_policy, "externalTrafficPolicy", ("Cluster", "Global"))
    return ServiceView(
        namespace,
        name,
        stype,
        cluster_ips=cluster_ips,
        ports=ports,
        external_ips=tuple(
            ip(text, f"spec.externalIPs[{i}]") for i, text in enumerate(spec.external_ips or ())
        ),
        lb_ingress_ips=_lb_ingress(raw.status) if balanced else (),
        external_local=external_local,
        internal_local=_policy(spec.internal_policy, "internalTrafficPolicy", ("Cluster",)),
        affinity_timeout=_affinity(spec),
        source_ranges=_source_ranges(spec.source_ranges) if balanced else (),
        health_check_node_port=(
            _health_check_port(spec.health_check_node_port) if balanced and external_local else 0
        ),
        labels=labels,
        annotations=annotations,
    )


def names(meta: M | None, *, namespaced: bool) -> tuple[str, str, M]:
    """(namespace, name, metadata) of an object; a namespaced one without a namespace is in
    "default"."""
    if meta is None:
        raise missing("metadata")
    if not meta.name:
        raise missing("metadata.name")
    return (meta.namespace or "default") if namespaced else "", meta.name, meta


def _health_check_port(value: int | None) -> int:
    """spec.healthCheckNodePort where kube-proxy serves it (NeedsHealthCheck: a
    LoadBalancer with externalTrafficPolicy Local); 0 when unset."""
    return 0 if not value else port(value, "spec.healthCheckNodePort")


def _service_type(value: str | None) -> ServiceType:
    if value is None:
        return ServiceType.CLUSTER_IP
    try:
        return ServiceType(value)
    except ValueError:
        raise bad("spec.type", value, f"is not one of {[t.value for t in ServiceType]}") from None


def _source_ranges(texts: list[str] | None) -> tuple[IPNetwork, ...]:
    where = "spec.loadBalancerSourceRanges"
    return tuple(cidr(text, f"{where}[{i}]", strip=True) for i, text in enumerate(texts or ()))


def _cluster_ips(spec: schema.ServiceSpec) -> tuple[IPAddress, ...] | None:
    """The Service's cluster IPs, one per family; None for a headless Service."""
    where, texts = "spec.clusterIPs", spec.cluster_ips
    if not texts:  # older objects and hand-written manifests: clusterIP alone
        where = "spec.clusterIP"
        if not spec.cluster_ip:
            raise missing(where)
        texts = [spec.cluster_ip]
    if "None" in texts:
        if texts != ["None"]:
            raise Malformed(f"{where} mixes None with addresses", field=where)
        return None
    addresses = tuple(ip(text, f"{where}[{i}]") for i, text in enumerate(texts))
    if len(addresses) > 2 or len({a.version for a in addresses}) != len(addresses):
        raise Malformed(f"{where} {texts} is not one address per family", field=where)
    return addresses


def _service_ports(items: list[schema.ServicePort] | None) -> tuple[ServicePortView, ...]:
    if not items:
        raise Malformed("spec.ports is missing or empty", field="spec.ports")
    ports = []
    for i, item in enumerate(items):
        where = f"spec.ports[{i}]"
        protocol = proto(item.protocol, f"{where}.protocol")
        number = port(item.port, f"{where}.port")
        node_port = item.node_port  # absent or 0: none allocated
        node_port = port(node_port, f"{where}.nodePort") if node_port else 0
        _target_port(item.target_port, f"{where}.targetPort")
        ports.append(ServicePortView(item.name or "", protocol, number, node_port))
    if len(ports) > 1 and (not all(p.name for p in ports)):
        raise Malformed(
            "spec.ports: every port of a multi-port Service needs a name", field="spec.ports"
        )
    if len({p.name for p in ports}) != len(ports):
        raise Malformed("spec.ports: duplicate port name", field="spec.ports")
    if len({(p.port, p.protocol) for p in ports}) != len(ports):
        raise Malformed("spec.ports: duplicate port and protocol", field="spec.ports")
    return tuple(ports)


def _target_port(value: int | str | None, where: str) -> None:
    """A number, a string of ASCII digits (a number), or a port name (core/v1 IntOrString;
    a name as IsValidPortName checks it). Only checked: the endpoints carry the ports."""
    if value is None or value == "":
        return
    if isinstance(value, str):
        if value.isascii() and value.isdigit():
            port(int(value), where)
        elif not _PORT_NAME.fullmatch(value) or "--" in value or not _LETTER.search(value):
            raise bad(where, value, "is neither a port number nor a name")
        return
    port(value, where)


_PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?")
_LETTER = re.compile(r"[a-z]")


def _lb_ingress(status: schema.ServiceStatus | None) -> tuple[IPAddress, ...]:
    lb = status.load_balancer if status is not None else None
    ips = []
    for i, ingress in enumerate(lb.ingress or () if lb is not None else ()):
        if ingress.ip and ingress.ip_mode != "Proxy":
            ips.append(ip(ingress.ip, f"status.loadBalancer.ingress[{i}].ip"))
    return tuple(ips)


def _policy(value: str | None, key: str, cluster_values: tuple[str, ...]) -> bool:
    if value is None or value in cluster_values:
        return False
    if value == "Local":
        return True
    raise bad(f"spec.{key}", value, "is neither Cluster nor Local")


def _affinity(spec: schema.ServiceSpec) -> int:
    affinity = spec.affinity
    if affinity in (None, "None", ""):
        return 0
    if affinity != "ClientIP":
        raise bad("spec.sessionAffinity", affinity, "is neither None nor ClientIP")
    config = spec.affinity_config
    client = config.client_ip if config is not None else None
    timeout = client.timeout_seconds if client is not None else None
    if timeout is None:
        return DEFAULT_AFFINITY_TIMEOUT
    if not 0 < timeout <= MAX_AFFINITY_TIMEOUT:
        where = "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
        raise bad(where, timeout, f"is not a number of seconds (1-{MAX_AFFINITY_TIMEOUT})")
    return timeout
