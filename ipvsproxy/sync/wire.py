"""Services and EndpointSlices decoded from their JSON text straight into views.

Owns: `parsed_json()`, the fast path of `tracker.parse()` for a `RawJson` object (an item of
a JSON manifest). Why it exists: at 1000 Services x 10 endpoints, `json.loads` builds every
field of every object (managedFields, targetRefs, ...) as Python dicts and api.py then reads
the few it needs; parsing was the largest single step of `run --once` (1.8 s of a 5.7 s
pass in the IPVS VM). msgspec (a well-kept C library) decodes only the fields named in the
structs below, skipping the rest without building them, and checks their JSON types on the
way; the endpoints, most of the work, become views here without a dict in between.

api.py stays the only judge of what an object means: the Service and the slice's head
(metadata, address type, ports) go through its parsers, from dicts holding only the fields
they read, and anything this module does not take exactly as api.py would (a JSON type
msgspec refuses, an endpoint with topology hints, an address api.py refuses, any Malformed)
returns None, and the caller parses the whole decoded object the ordinary way, which names
the problem. tests/test_api_fuzz.py checks that both ways give the same result for every
field of every kind set to any JSON value.

Imports: api, model, msgspec, the standard library.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from ipaddress import IPv4Address
from socket import AF_INET, inet_pton
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from ipvsproxy.api import (
    EndpointSliceView,
    EndpointView,
    Malformed,
    RawObject,
    ServiceView,
    parse_ip,
    parse_service,
    slice_head,
    with_endpoints,
)
from ipvsproxy.model import IPAddress

_SERVICE, _SLICE = "Service", "EndpointSlice"


class _Meta(Struct):
    """The metadata fields the parsers and the tracker read, of any JSON type."""

    name: Any = None
    namespace: Any = None
    labels: Any = None
    annotations: Any = None

    def builtins(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "labels": self.labels,
            "annotations": self.annotations,
        }


class _Service(Struct):
    metadata: _Meta | None = None
    spec: Any = None
    status: Any = None


class _Conditions(Struct):
    ready: bool | None = None
    serving: bool | None | UnsetType = UNSET  # absent: as ready (api._conditions)
    terminating: bool | None = None


class _Endpoint(Struct):
    addresses: list[str] | None = None
    conditions: _Conditions | None = None
    nodeName: str | None = None  # noqa: N815 - the JSON field's name
    hints: Any = None


class _Slice(Struct):
    metadata: _Meta | None = None
    addressType: Any = None  # noqa: N815
    ports: Any = None
    endpoints: list[_Endpoint] | None = None


_SERVICES = msgspec.json.Decoder(_Service)
_SLICES = msgspec.json.Decoder(_Slice)

View = ServiceView | EndpointSliceView


def parsed_json(kind: str, data: bytes) -> tuple[RawObject, View] | None:
    """(a dict of the object's metadata, its view) for a Service or an EndpointSlice that
    api.py takes as it is; None for anything else (the caller decodes and parses it)."""
    try:
        if kind == _SERVICE:
            return _service(_SERVICES.decode(data))
        if kind == _SLICE:
            return _slice(_SLICES.decode(data))
    except (msgspec.MsgspecError, RecursionError, Malformed):
        pass
    return None


def _service(raw: _Service) -> tuple[RawObject, View] | None:
    if raw.metadata is None:
        return None
    obj = {"metadata": raw.metadata.builtins(), "spec": raw.spec, "status": raw.status}
    return obj, parse_service(obj)


def _slice(raw: _Slice) -> tuple[RawObject, View] | None:
    if raw.metadata is None:
        return None
    obj = {"metadata": raw.metadata.builtins(), "addressType": raw.addressType, "ports": raw.ports}
    head, version = slice_head(obj)
    if not version:
        return obj, head
    endpoints = _endpoints(raw.endpoints or (), version)
    if endpoints is None:
        return None
    return obj, with_endpoints(head, endpoints)


def _endpoints(items: list[_Endpoint] | tuple[()], version: int) -> tuple[EndpointView, ...] | None:
    """api._endpoint for endpoints whose fields have their JSON types already; None where it
    would take a closer look (hints) or refuse one (the caller's parse names it)."""
    out = []
    for item in items:
        addresses = item.addresses
        if not addresses or item.hints is not None:
            return None
        text = addresses[0]
        if version == 4 and ":" not in text:
            try:  # api._ip's IPv4 path, without its checks of what msgspec checked
                inet_pton(AF_INET, text)
                address: IPAddress = IPv4Address(text)
            except (OSError, ValueError):  # ValueError: a NUL in the text
                return None
        else:
            address = parse_ip(text)
            if address.version != version:
                return None
        cond = item.conditions
        node = sys.intern(item.nodeName) if item.nodeName else ""
        if cond is None:
            out.append(_view(address, True, True, False, node))
            continue
        serving = cond.ready if cond.serving is UNSET else cond.serving
        out.append(
            _view(
                address,
                cond.ready is not False,
                serving is not False,
                cond.terminating is True,
                node,
            )
        )
    return tuple(out)


# EndpointView built through its slot descriptors rather than the generated __init__, which
# calls object.__setattr__ once per field (half the cost, as model.destination): one per
# endpoint of every slice read. Checked against the constructor at import.
_SETTERS = tuple(EndpointView.__dict__[f.name].__set__ for f in fields(EndpointView))
_NO_HINTS: frozenset[str] = frozenset()


def _view(
    address: IPAddress, ready: bool, serving: bool, terminating: bool, node: str
) -> EndpointView:
    view = object.__new__(EndpointView)
    set_address, set_ready, set_serving, set_terminating, set_node, set_zones, set_nodes = _SETTERS
    set_address(view, address)
    set_ready(view, ready)
    set_serving(view, serving)
    set_terminating(view, terminating)
    set_node(view, node)
    set_zones(view, _NO_HINTS)
    set_nodes(view, _NO_HINTS)
    return view


def _check_view() -> None:
    sample = IPv4Address("192.0.2.1")
    if len(_SETTERS) != 7 or _view(
        sample, True, False, True, "n"
    ) != EndpointView(  # pragma: no cover
        sample, True, False, True, "n"
    ):
        raise ImportError(  # pragma: no cover
            "wire._view no longer builds what EndpointView() does"
        )


_check_view()
