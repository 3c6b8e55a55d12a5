"""The fields ipvsproxy reads of a Service, an EndpointSlice and a Node, as msgspec structs.

Owns: the structs, `decode()` (JSON text, straight into them) and `convert()` (dicts: YAML
manifests, watch events already decoded), and `field_error()`, which renders msgspec's
ValidationError as the parser's messages do (`spec.ports[0].port: expected an integer, got
str`). Only the fields named here are built; the rest of an object (managedFields, the
last-applied annotation's copy of the object...) is skipped without being
decoded. Every field may be absent or null (`None`): api/validate.py says which are required
and what a value means, so the messages for a missing field stay its own.

Imports: msgspec, the standard library.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType, field

StrMap = dict[str, str]


class Base(Struct, gc=False):
    """Decoded trees hold no cycles: the garbage collector need not track them."""


class Meta(Base):
    name: str | None = None
    namespace: str | None = None
    labels: StrMap | None = None
    annotations: StrMap | None = None


class NodeMeta(Meta):
    # any value but null and "" means "being deleted" (YAML reads a timestamp as a datetime)
    deletion_timestamp: Any = field(default=None, name="deletionTimestamp")


class ServicePort(Base):
    name: str | None = None
    protocol: str | None = None
    port: int | None = None
    node_port: int | None = field(default=None, name="nodePort")
    target_port: int | str | None = field(default=None, name="targetPort")


class ClientIP(Base):
    timeout_seconds: int | None = field(default=None, name="timeoutSeconds")


class AffinityConfig(Base):
    client_ip: ClientIP | None = field(default=None, name="clientIP")


class ServiceSpec(Base):
    type: str | None = None
    cluster_ip: str | None = field(default=None, name="clusterIP")
    cluster_ips: list[str] | None = field(default=None, name="clusterIPs")
    ports: list[ServicePort] | None = None
    external_ips: list[str] | None = field(default=None, name="externalIPs")
    external_policy: str | None = field(default=None, name="externalTrafficPolicy")
    internal_policy: str | None = field(default=None, name="internalTrafficPolicy")
    affinity: str | None = field(default=None, name="sessionAffinity")
    affinity_config: AffinityConfig | None = field(default=None, name="sessionAffinityConfig")
    source_ranges: list[str] | None = field(default=None, name="loadBalancerSourceRanges")
    health_check_node_port: int | None = field(default=None, name="healthCheckNodePort")


class Ingress(Base):
    ip: str | None = None
    ip_mode: str | None = field(default=None, name="ipMode")


class LoadBalancerStatus(Base):
    ingress: list[Ingress] | None = None


class ServiceStatus(Base):
    load_balancer: LoadBalancerStatus | None = field(default=None, name="loadBalancer")


class Service(Base):
    metadata: Meta | None = None
    spec: ServiceSpec | None = None
    status: ServiceStatus | None = None


class SlicePort(Base):
    name: str | None = None
    protocol: str | None = None
    port: int | None = None


class Conditions(Base):
    ready: bool | None = None
    serving: bool | None | UnsetType = UNSET  # absent: as ready; null: unknown
    terminating: bool | None = None


class Hint(Base):
    name: str | None = None


class Hints(Base):
    for_zones: list[Hint] | None = field(default=None, name="forZones")
    for_nodes: list[Hint] | None = field(default=None, name="forNodes")


class TargetRef(Base):
    kind: str | None = None
    name: str | None = None


class Endpoint(Base):
    addresses: list[str] | None = None
    conditions: Conditions | None = None
    node_name: str | None = field(default=None, name="nodeName")
    hints: Hints | None = None
    target_ref: TargetRef | None = field(default=None, name="targetRef")  # for `status`
    zone: str | None = None


class EndpointSlice(Base):
    metadata: Meta | None = None
    address_type: str | None = field(default=None, name="addressType")
    ports: list[SlicePort] | None = None
    endpoints: list[Endpoint] | None = None


class Taint(Base):
    key: str | None = None


class NodeSpec(Base):
    pod_cidr: str | None = field(default=None, name="podCIDR")
    pod_cidrs: list[str] | None = field(default=None, name="podCIDRs")
    taints: list[Taint] | None = None


class NodeAddress(Base):
    type: str | None = None
    address: str | None = None


class NodeStatus(Base):
    addresses: list[NodeAddress] | None = None


class Node(Base):
    metadata: NodeMeta | None = None
    spec: NodeSpec | None = None
    status: NodeStatus | None = None


class IdentMeta(Base):
    name: Any = None
    namespace: Any = None


class Ident(Base):
    """Only what names an object in a warning, of any type (the object failed to decode)."""

    metadata: IdentMeta | None = None


Object = Service | EndpointSlice | Node
TYPES: dict[str, type[Object]] = {"Service": Service, "EndpointSlice": EndpointSlice, "Node": Node}
_DECODERS = {kind: msgspec.json.Decoder(t) for kind, t in TYPES.items()}
_IDENT = msgspec.json.Decoder(Ident)


def decode(kind: str, data: bytes) -> Object:
    """The object of `kind` in JSON text (msgspec.ValidationError: a field of the wrong
    type; msgspec.DecodeError: not JSON; RecursionError: nested too deeply)."""
    return _DECODERS[kind].decode(data)


def convert(kind: str, obj: object) -> Object:
    """The object of `kind` in decoded JSON or YAML (msgspec.ValidationError, RecursionError)."""
    return msgspec.convert(obj, TYPES[kind])


def ident(data: bytes) -> dict[str, Any] | None:
    """The name and namespace in an object's JSON text as json.loads reads them; None if
    they cannot be read."""
    try:
        meta = _IDENT.decode(data).metadata
    except (msgspec.MsgspecError, RecursionError):
        return None
    return None if meta is None else {"name": meta.name, "namespace": meta.namespace}


# "Expected `int | null`, got `str` - at `$.spec.ports[0].port`"; a key: "... - at `key` in
# `$.metadata.labels`"; the object itself: no path.
_AT = re.compile(r"(?s)(.*?) - at `(key` in `)?\$\.?([^`]*)`")
_TYPES = re.compile(r"Expected `([^`]*)`(?:, got `([^`]*)`)?")
_EXPECTED = {
    "object": "an object",
    "array": "a list",
    "str": "a string",
    "int": "an integer",
    "bool": "true, false or null",
    "int | str": "a port number or name",
}
# JSON's names, as Python calls them; one for numbers: JSON text has no int or float, and
# msgspec names a number past 64 bits in the text a float, in a dict an int
_GOT = {"array": "list", "int": "number", "float": "number"}


def field_error(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(the field at fault, "" for the object itself; the message, starting with it)."""
    text = str(exc)
    at = _AT.fullmatch(text)
    what, is_key, where = at.groups() if at else (text, None, "")
    types = _TYPES.fullmatch(what)
    if types is None:
        problem = what.replace("`", "")
        problem = problem[:1].lower() + problem[1:]
    else:
        expected = types.group(1).removesuffix(" | null")
        got = types.group(2)
        if is_key:
            problem = "has a key that is not a string"
        else:
            problem = f"expected {_EXPECTED.get(expected, expected)}"
        if got:
            problem += f", got {_GOT.get(got, got)}"
    return where, f"{where}: {problem}" if where else problem
