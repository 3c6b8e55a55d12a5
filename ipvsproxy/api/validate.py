"""The one object parser: raw objects to frozen views, or to a warning; never an exception.

Owns: `read()`, one object of a kind (a dict, or a `RawJson`'s text) to its view (`Read`),
and `parse_objects()`, a batch of dicts. msgspec decodes the fields api/schema.py names and
checks their JSON types; this module checks what they mean (port ranges, protocols, IP
addresses and CIDRs, duplicate ports, affinity timeouts, topology hints, condition defaults).
A malformed object (a field of the wrong type, a value not valid there, a missing required
field) becomes a warning that names the object and the field, whatever JSON (or YAML: dates,
sets, binary) the fields hold and however deep it nests: the caller skips it and reads the
others (tests/test_api_parse.py). A null field reads as an absent one.

Imports: api.views, api.schema, api.values and the views' builders (api.services, api.slices,
api.nodes), msgspec, the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ipvsproxy.api import schema
from ipvsproxy.api.nodes import node_view
from ipvsproxy.api.services import service_view
from ipvsproxy.api.slices import slice_view
from ipvsproxy.api.values import Malformed, shown
from ipvsproxy.api.views import (
    TRIGGER_TIME,
    EndpointSliceView,
    NodeView,
    Parsed,
    RawJson,
    Read,
    Ref,
    ServiceView,
    View,
)

SERVICE, SLICE, NODE = "Service", "EndpointSlice", "Node"
_VIEWS: dict[str, Any] = {SERVICE: service_view, SLICE: slice_view, NODE: node_view}
_NO_KEY: Ref = ("", "")


def read(kind: str, obj: object) -> Read:
    """A Service, EndpointSlice or Node (`kind`) from a decoded object or its JSON text:
    its view, or a warning naming it and the field at fault. Pure; raises nothing."""
    raw = _decoded(kind, obj)
    if isinstance(raw, Read):
        return raw
    meta = raw.metadata
    key = (meta.namespace or "", meta.name or "") if meta is not None else _NO_KEY
    try:
        view: View = _VIEWS[kind](raw)
    except Malformed as exc:
        return Read(key, None, f"skipping malformed {kind} {_named(meta)}: {exc}")
    trigger = ""
    if kind == SLICE and meta is not None and meta.annotations:
        trigger = meta.annotations.get(TRIGGER_TIME, "")
    return Read(key, view, trigger=trigger)


def _decoded(kind: str, obj: object) -> schema.Object | Read:
    """The fields of `obj` that the views are made of, with their JSON types checked; or
    the warning that says why not."""
    if isinstance(obj, RawJson):
        try:
            return schema.decode(kind, obj.data)
        except msgspec.ValidationError as exc:
            where, message = schema.field_error(exc)
            if not where and message.startswith("expected an object"):
                return Read(_NO_KEY, None, f"skipping {kind}: {message}")
            return _malformed(kind, obj, message)
        except msgspec.DecodeError as exc:
            return Read(_NO_KEY, None, f"skipping {kind}: invalid JSON: {exc}")
        except RecursionError:
            return _malformed(kind, obj, "nested too deeply")
    if not isinstance(obj, Mapping):
        return Read(_NO_KEY, None, f"skipping {kind}: expected an object, got {_type(obj)}")
    try:
        return schema.convert(kind, obj)
    except msgspec.ValidationError as exc:
        return _malformed(kind, obj, schema.field_error(exc)[1])
    except RecursionError:
        return _malformed(kind, obj, "nested too deeply")


def _malformed(kind: str, obj: Mapping[str, Any] | RawJson, message: str) -> Read:
    """The warning for an object msgspec refused, named from its metadata as it is."""
    meta = schema.ident(obj.data) if isinstance(obj, RawJson) else obj.get("metadata")
    return Read(_key(meta), None, f"skipping malformed {kind} {describe(meta)}: {message}")


def key_of(obj: object) -> Ref:
    """(namespace, name) of a raw object as given ("" where absent or not a string)."""
    return _key(obj.get("metadata") if isinstance(obj, Mapping) else None)


def _key(meta: object) -> Ref:
    if not isinstance(meta, Mapping):
        return _NO_KEY
    namespace, name = meta.get("namespace"), meta.get("name")
    return (namespace if isinstance(namespace, str) else "", name if isinstance(name, str) else "")


def _named(meta: schema.Meta | None) -> str:
    if meta is None:
        return "<no metadata>"
    return f"{meta.namespace}/{meta.name}" if meta.namespace else str(meta.name)


def describe(meta: object) -> str:
    """namespace/name of a raw object's metadata, as far as it can be read."""
    if not isinstance(meta, Mapping):
        return "<no metadata>"
    name, namespace = meta.get("name"), meta.get("namespace")
    name = name if isinstance(name, str) else shown(name)
    if isinstance(namespace, str) or not namespace:
        return f"{namespace}/{name}" if namespace else name
    return f"{shown(namespace)}/{name}"


def _type(value: object) -> str:
    """A value's type as JSON names it (as YAML may also give dates, bytes, sets...)."""
    if value is None:
        return "null"
    return type(value).__name__


def parse_objects(objects: Iterable[object]) -> Parsed:
    """Services, EndpointSlices and Nodes of decoded objects; other kinds are ignored, bad
    ones warned."""
    services: list[ServiceView] = []
    slices: list[EndpointSliceView] = []
    nodes: list[NodeView] = []
    found: dict[str, list[Any]] = {SERVICE: services, SLICE: slices, NODE: nodes}
    warnings: list[str] = []
    for obj in objects:
        kind = obj.get("kind") if isinstance(obj, Mapping) else None
        views = found.get(kind) if isinstance(kind, str) else None
        if views is None:
            continue
        item = read(kind, obj)  # type: ignore[arg-type]
        if item.view is None:
            warnings.append(item.warning)
        else:
            views.append(item.view)
    return Parsed(tuple(services), tuple(slices), tuple(nodes), tuple(warnings))
