"""The Kubernetes objects ipvsproxy reads: frozen views, and the one parser that makes them.

A raw object (a dict from a YAML manifest or a watch event, or a JSON manifest item's text)
is decoded by msgspec into the structs of api/schema.py, which name only the fields ipvsproxy
reads and check their JSON types; api/services.py, slices.py and nodes.py check what the
values mean and build the views of api/views.py. `read()` (api/validate.py) is the only way
in: it returns a view or a warning naming the object and the field, never an exception.

Imports: model, msgspec, the standard library. Never the Kubernetes client: raw objects only.
"""

from ipvsproxy.api.validate import NODE, SERVICE, SLICE, describe, key_of, parse_objects, read
from ipvsproxy.api.views import (
    DEFAULT_AFFINITY_TIMEOUT,
    HEADLESS_LABEL,
    KEPT_META_PREFIXES,
    MAX_AFFINITY_TIMEOUT,
    PROXY_NAME_LABEL,
    SERVICE_NAME_LABEL,
    TRIGGER_TIME,
    ZONE_LABEL,
    EndpointPortView,
    EndpointSliceView,
    EndpointView,
    NodeView,
    Parsed,
    RawJson,
    RawObject,
    Read,
    Ref,
    ServicePortView,
    ServiceType,
    ServiceView,
    View,
)

__all__ = [
    "DEFAULT_AFFINITY_TIMEOUT",
    "KEPT_META_PREFIXES",
    "MAX_AFFINITY_TIMEOUT",
    "NODE",
    "HEADLESS_LABEL",
    "PROXY_NAME_LABEL",
    "SERVICE",
    "SERVICE_NAME_LABEL",
    "SLICE",
    "TRIGGER_TIME",
    "ZONE_LABEL",
    "EndpointPortView",
    "EndpointSliceView",
    "EndpointView",
    "NodeView",
    "Parsed",
    "RawJson",
    "RawObject",
    "Read",
    "Ref",
    "ServicePortView",
    "ServiceType",
    "ServiceView",
    "View",
    "describe",
    "key_of",
    "parse_objects",
    "read",
]
