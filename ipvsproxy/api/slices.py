"""A decoded EndpointSlice (api/schema.py) to its `EndpointSliceView`.

The endpoints are the hot path of parsing (every endpoint of every slice): their checks are
inline and a field's path is spelled only for an error.

Imports: api.views, api.schema, api.values, api.services, model, msgspec, the standard library.
"""

from __future__ import annotations

from msgspec import UNSET

from ipvsproxy.api import schema
from ipvsproxy.api.services import names
from ipvsproxy.api.values import Malformed, bad, ip, missing, name, port, proto
from ipvsproxy.api.views import (
    NOT_PROXIED_LABELS,
    SERVICE_NAME_LABEL,
    EndpointPortView,
    EndpointSliceView,
    EndpointView,
)

_VERSIONS = {"IPv4": 4, "IPv6": 6, "FQDN": 0}
_NO_HINTS: frozenset[str] = frozenset()


def slice_view(raw: schema.EndpointSlice) -> EndpointSliceView:
    namespace, slice_name, meta = names(raw.metadata, namespaced=True)
    address_type = raw.address_type
    version = _VERSIONS.get(address_type) if address_type is not None else None
    if address_type is None or version is None:
        raise bad("addressType", address_type, "is not IPv4, IPv6 or FQDN")
    service_name = meta.labels.get(SERVICE_NAME_LABEL, "") if meta.labels else ""
    if meta.labels and any(label in meta.labels for label in NOT_PROXIED_LABELS):
        # not selected by kube-proxy's informers (api/views.py NOT_PROXIED_LABELS): the slice
        # belongs to no Service here, so a label added takes it from its Service as a deletion
        service_name = ""
    if not version:  # an FQDN slice: its endpoints are no IP addresses, and not read
        return EndpointSliceView(namespace, slice_name, service_name, address_type)
    ports = []
    for i, item in enumerate(raw.ports or ()):
        if item.port is None:  # a nil port means "all ports": unusable for IPVS
            continue
        where = f"ports[{i}]"
        protocol = proto(item.protocol, f"{where}.protocol")
        ports.append(EndpointPortView(item.name or "", protocol, port(item.port, f"{where}.port")))
    endpoints = tuple(_endpoint(item, i, version) for i, item in enumerate(raw.endpoints or ()))
    return EndpointSliceView(
        namespace, slice_name, service_name, address_type, tuple(ports), endpoints
    )


def _endpoint(item: schema.Endpoint, i: int, version: int) -> EndpointView:
    addresses = item.addresses
    if not addresses:
        raise missing(f"endpoints[{i}].addresses")
    address = ip(addresses[0], f"endpoints[{i}].addresses[0]")  # consumers use the first
    if address.version != version:
        where = f"endpoints[{i}].addresses[0]"
        raise Malformed(f"{where}: {address} is not an IPv{version} address", field=where)
    node = name(item.node_name) if item.node_name else ""  # a few names, 100,000s of endpoints
    cond = item.conditions
    if cond is None:
        ready = serving = True
        terminating = False
    else:
        # discovery/v1: a nil ready or serving condition means "unknown", read as true; an
        # absent serving condition is as ready
        ready = cond.ready is not False
        serving = ready if cond.serving is UNSET else cond.serving is not False
        terminating = cond.terminating is True
    pod = _target(item.target_ref)
    zone = name(item.zone) if item.zone else ""
    if item.hints is None:
        return EndpointView(address, ready, serving, terminating, node, pod=pod, zone=zone)
    where = f"endpoints[{i}].hints"
    zones = _hinted(item.hints.for_zones, f"{where}.forZones")
    nodes = _hinted(item.hints.for_nodes, f"{where}.forNodes")
    return EndpointView(address, ready, serving, terminating, node, zones, nodes, pod, zone)


def _target(ref: schema.TargetRef | None) -> str:
    """What `status` names an endpoint by: its pod's name ("Kind/name" for another kind)."""
    if ref is None or not ref.name:
        return ""
    return ref.name if ref.kind in (None, "", "Pod") else f"{ref.kind}/{ref.name}"


def _hinted(hints: list[schema.Hint] | None, where: str) -> frozenset[str]:
    """The names of an endpoint's `hints.forZones` or `hints.forNodes`."""
    if not hints:
        return _NO_HINTS
    names = []
    for i, hint in enumerate(hints):
        if not hint.name:
            raise missing(f"{where}[{i}].name")
        names.append(name(hint.name))
    return frozenset(names)
