"""Frozen views of the Kubernetes objects ipvsproxy reads: what the rest of the code sees.

Owns: `ServiceView`, `ServicePortView`, `EndpointSliceView`, `EndpointView`, `NodeView`, the
carriers around them (`RawJson`, one object's JSON text; `Read`, one object read; `Parsed`,
a batch read) and the label and annotation names they are keyed by. Field meanings follow the
core/v1 Service and discovery.k8s.io/v1 EndpointSlice API reference (endpoints' topology hints
included). Building them from raw objects is api/validate.py's job.

Imports: model, the standard library.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ipvsproxy.model import IPAddress, IPNetwork, Proto

RawObject = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RawJson:
    """One object's JSON text, not decoded yet: an item of a JSON manifest's List, whose
    `kind` was read (api/validate.py decodes the fields ipvsproxy reads straight from it)."""

    kind: str
    data: bytes


Ref = tuple[str, str]  # (namespace, name) of an object; namespace "" for cluster-scoped ones

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
# set by the endpoint controllers on the slices of a headless Service (v1.IsHeadlessService)
HEADLESS_LABEL = "service.kubernetes.io/headless"
# kube-proxy lists and watches Services and EndpointSlices with the label selector
# `!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`
# (cmd/kube-proxy/app/server.go): an object carrying either is not there for a proxy, and a
# label added is, to its watch, a deletion
NOT_PROXIED_LABELS = (PROXY_NAME_LABEL, HEADLESS_LABEL)
ZONE_LABEL = "topology.kubernetes.io/zone"  # a Node's zone, matched by endpoints' zone hints
# EndpointSlice annotation set by the endpoint controllers: when the change that produced this
# slice happened (for kubeproxy_network_programming_duration_seconds).
TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
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
    # what `status` shows of it: its pod (targetRef's name; "Kind/name" for another kind)
    # and its zone, "" when the slice does not say
    pod: str = ""
    zone: str = ""


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


View = ServiceView | EndpointSliceView | NodeView


@dataclass(frozen=True, slots=True)
class Read:
    """One object read: its view, or the warning that names it and the field at fault."""

    key: Ref  # metadata (namespace, name) as given, "" where absent or not a string
    view: View | None
    warning: str = ""
    trigger: str = ""  # an EndpointSlice's TRIGGER_TIME annotation


@dataclass(frozen=True, slots=True)
class Parsed:
    services: tuple[ServiceView, ...] = ()
    slices: tuple[EndpointSliceView, ...] = ()
    nodes: tuple[NodeView, ...] = ()
    warnings: tuple[str, ...] = ()
