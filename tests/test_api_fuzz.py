"""No wrongly-shaped field escapes the parser as anything but a warning (issue 14).

api.py promises: an object whose fields have the wrong shape is skipped with a warning that
names the object and the field; parsing never raises anything but `Malformed`. First the
shapes that raised before (each one reproduced as an operator met it: `diff --manifests`),
then hypothesis substitutes arbitrary JSON values into every field the parser reads.
"""

from __future__ import annotations

import ast
import copy
import datetime as dt
import json
import re
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipvsproxy.api import (
    EndpointSliceView,
    Malformed,
    NodeView,
    Parsed,
    RawJson,
    ServiceView,
    describe,
    parse_node,
    parse_objects,
    parse_service,
    parse_slice,
)
from ipvsproxy.cli import main
from ipvsproxy.sync import tracker, wire
from tests.factories import ep, node, port, service, slice_

# ---- the shapes that raised before -------------------------------------------------------


def _lb(**spec: Any) -> Any:
    return service("web", type="LoadBalancer", ports=[port(node_port=30080)], **spec)


REGRESSIONS = {
    "sessionAffinityConfig a string": (
        service("web", sessionAffinity="ClientIP", sessionAffinityConfig="x"),
        "Service default/web: spec.sessionAffinityConfig: expected an object, got str",
    ),
    "status.loadBalancer a string": (
        {**_lb(), "status": {"loadBalancer": "x"}},
        "Service default/web: status.loadBalancer: expected an object, got str",
    ),
    "status.loadBalancer.ingress a number": (
        {**_lb(), "status": {"loadBalancer": {"ingress": 5}}},
        "Service default/web: status.loadBalancer.ingress: expected a list, got int",
    ),
    "endpoint conditions a list": (
        slice_(endpoints=[{"addresses": ["10.244.0.1"], "conditions": [{"ready": True}]}]),
        "EndpointSlice default/web-abcde: endpoints[0].conditions: expected an object, got list",
    ),
    "targetPort a non-ASCII digit": (
        service("web", ports=[port(target="²")]),
        "Service default/web: spec.ports[0].targetPort '²' is neither a port number nor a name",
    ),
}


@pytest.mark.parametrize(("obj", "warning"), REGRESSIONS.values(), ids=REGRESSIONS.keys())
def test_a_wrongly_shaped_field_is_a_warning_naming_object_and_field(obj, warning):
    good = service("other", cluster_ips=("10.96.0.99",))
    parsed = parse_objects([obj, good])
    assert parsed.warnings == (f"skipping malformed {warning}",)
    assert [s.name for s in parsed.services] == ["other"]


# Shapes that did not raise but were misread: now warnings too.
MISREAD = {
    "a condition as a string": (
        slice_(endpoints=[{"addresses": ["10.244.0.1"], "conditions": {"ready": "false"}}]),
        "EndpointSlice default/web-abcde: endpoints[0].conditions.ready: "
        "expected true, false or null, got str",
    ),
    "a source range as a number": (
        _lb(loadBalancerSourceRanges=[5]),
        "Service default/web: spec.loadBalancerSourceRanges[0]: expected a string, got int",
    ),
    "a scoped IPv6 cluster IP": (
        service("web", cluster_ips=("fe80::1%eth0",)),
        "Service default/web: spec.clusterIPs[0] 'fe80::1%eth0' is not an IP address",
    ),
    "nodePort false (read as none)": (
        service("web", type="NodePort", ports=[port(node_port=False)]),
        "Service default/web: spec.ports[0].nodePort False is not a port number (1-65535)",
    ),
    "a pod CIDR as a number": (
        {**node("node-a"), "spec": {"podCIDRs": [10]}},
        "Node node-a: spec.podCIDRs[0]: expected a string, got int",
    ),
}


@pytest.mark.parametrize(("obj", "warning"), MISREAD.values(), ids=MISREAD.keys())
def test_a_misread_shape_is_a_warning_naming_object_and_field(obj, warning):
    assert parse_objects([obj]).warnings == (f"skipping malformed {warning}",)


def test_a_value_shared_a_billion_times_is_named_briefly():
    """YAML aliases make a few lines a tree of 9**30 leaves; its repr would never end."""
    bomb: list[Any] = ["lol"]
    for _ in range(30):
        bomb = [bomb] * 9
    obj = service("web", ports=[{"port": bomb}])
    (warning,) = parse_objects([obj]).warnings
    assert warning.startswith("skipping malformed Service default/web: spec.ports[0].port [[[")
    assert len(warning) < 300
    obj = service("web", ns=bomb)
    obj["metadata"]["name"] = bomb
    (warning,) = parse_objects([obj]).warnings
    assert warning.startswith("skipping malformed Service [[[")
    assert len(warning) < 600


@pytest.mark.parametrize(("obj", "warning"), REGRESSIONS.values(), ids=REGRESSIONS.keys())
def test_diff_warns_and_plans_the_rest_instead_of_a_traceback(tmp_path, obj, warning):
    other = service("other", cluster_ips=("10.96.0.99",))
    objects = [obj, other, slice_("other", endpoints=[ep("10.244.0.1")]), node("node-a")]
    manifest = tmp_path / "objects.json"
    manifest.write_text(json.dumps({"kind": "List", "items": objects}))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = CliRunner().invoke(
        main,
        ["diff", "--manifests", str(manifest), "--kernel-state", str(empty)]
        + ["--hostname-override", "node-a"],
    )
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    assert warning in result.stderr
    assert "10.96.0.99:80" in result.stdout


# ---- every field, any JSON value -----------------------------------------------------------
#
# Complete objects that use every field the parser reads (a dual-stack LoadBalancer with
# affinity, source ranges and an ingress; a slice with conditions; a node with pod CIDRs).
# Each test picks one position in such an object (a field, or a whole subtree such as
# `spec` or `spec.ports[0]`), puts an arbitrary value there or deletes it, and parses.

SERVICE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {
        "name": "web",
        "namespace": "default",
        "labels": {"app": "web", "service.kubernetes.io/service-proxy-name": "ipvsproxy"},
        "annotations": {"ipvsproxy.io/scheduler": "lc"},
    },
    "spec": {
        "type": "LoadBalancer",
        "clusterIP": "10.96.0.10",
        "clusterIPs": ["10.96.0.10", "fd00:96::10"],
        "ports": [
            {"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080, "nodePort": 30080},
            {"name": "dns", "protocol": "UDP", "port": 53, "targetPort": "dns", "nodePort": 30053},
        ],
        "externalIPs": ["192.0.2.10"],
        "externalTrafficPolicy": "Local",
        "internalTrafficPolicy": "Cluster",
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
        "loadBalancerSourceRanges": ["203.0.113.0/24"],
    },
    "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.10", "ipMode": "VIP"}]}},
}
SLICE: dict[str, Any] = {
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {
        "name": "web-abcde",
        "namespace": "default",
        "labels": {"kubernetes.io/service-name": "web"},
        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2024-01-01T00:00:00Z"},
    },
    "addressType": "IPv4",
    "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
    "endpoints": [
        {
            "addresses": ["10.244.0.1"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "nodeName": "node-a",
            "hints": {"forZones": [{"name": "a"}], "forNodes": [{"name": "node-a"}]},
        }
    ],
}
NODE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "a"}},
    "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24", "fd00:244::/64"]},
    "status": {
        "addresses": [
            {"type": "InternalIP", "address": "192.168.0.10"},
            {"type": "Hostname", "address": "node-a"},
        ]
    },
}
PARSERS = {
    "Service": (parse_service, ServiceView),
    "EndpointSlice": (parse_slice, EndpointSliceView),
    "Node": (parse_node, NodeView),
}
OBJECTS = {"Service": SERVICE, "EndpointSlice": SLICE, "Node": NODE}

Path = tuple[str | int, ...]


def positions(value: object, path: Path = ()) -> list[Path]:
    """Every field, list item and subtree of a raw object (not the object itself)."""
    out: list[Path] = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += positions(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += positions(item, (*path, index))
    return out


def field_path(field: str) -> Path:
    """`spec.ports[0].name` or `metadata.labels['app']` as a path: ("spec", "ports", 0, ...)."""
    out: list[str | int] = []
    for index, quoted, name in re.findall(
        r"\[(\d+)\]|\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]|([^.\[\]]+)", field
    ):
        out.append(int(index) if index else ast.literal_eval(quoted) if quoted else name)
    return tuple(out)


# Interesting strings: valid values of some field (so a substitution may be valid elsewhere
# than its own field), look-alikes (non-ASCII digits, which str.isdigit() accepts and int()
# may refuse), and the empty string.
WORDS = st.sampled_from(
    ["", " ", "None", "ClientIP", "Local", "Cluster", "LoadBalancer", "ExternalName", "NodePort",
     "TCP", "SCTP", "tcp", "IPv4", "IPv6", "FQDN", "Proxy", "InternalIP", "http", "dns",
     "10.96.0.10", "fd00:96::10", "fe80::1%eth0", "10.0.0.0/8", "10.0.0.1/33", "::/0",
     "8080", "0", "65536", "²", "٣", "１２", "80\x00", "kubernetes.io/service-name"]
)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, 1, -1, 80, 65535, 65536, 86400, 86401, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=3)  # "²", "٣"
    | WORDS
)
# what YAML manifests add to JSON's types (PyYAML's SafeLoader: !!timestamp, !!binary, !!set)
YAML_SCALARS = st.dates() | st.datetimes() | st.binary(max_size=8)
KEYS = st.sampled_from(sorted({str(p[-1]) for o in OBJECTS.values() for p in positions(o)}))
VALUES = st.recursive(
    SCALARS | YAML_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(KEYS | st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=10,
)
ABSENT = object()  # the key deleted


def substituted(obj: dict[str, Any], path: Path, value: object) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    parent: Any = out
    for key in path[:-1]:
        parent = parent[key]
    if value is ABSENT:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def related(field: Path, path: Path) -> bool:
    """Whether an error in `field` can be due to a change at `path`: the same field, one
    inside it (a subtree was replaced) or around it (`spec.ports`: duplicate names)."""
    common = min(len(field), len(path))
    return field[:common] == path[:common] or (
        # a slice's addressType decides which address family its endpoints must have
        path == ("addressType",) and field[0] == "endpoints"
    )


def same_from_json(kind: str, obj: object) -> None:
    """The tracker parses the object's JSON text (a JSON manifest's List item: sync/wire.py
    decodes what it can straight into the view) exactly as it parses the decoded object:
    the same view, key and trigger, or the same warning."""
    try:
        text = json.dumps(obj)
    except (TypeError, ValueError, RecursionError):  # YAML's dates, bytes and sets
        return
    assert tracker.parse(kind, RawJson(kind, text.encode())) == tracker.parse(
        kind, json.loads(text)
    )


def check(kind: str, obj: dict[str, Any], path: Path | None) -> None:
    """parse_<kind> returns a view or raises Malformed naming a field (related to `path`,
    when the object was changed there); parse_objects and the tracker skip the object with
    a warning naming the object and the field; from its JSON text, the same."""
    same_from_json(kind, obj)
    parse, view_type = PARSERS[kind]
    error: Malformed | None = None
    try:
        view = parse(obj)
    except Malformed as exc:  # anything else fails the test
        error = exc
    if error is None:
        assert isinstance(view, view_type)
        assert parse_objects([obj]).warnings == ()
        assert tracker.parse(kind, obj).view == view
        return
    field = error.field
    assert str(error).startswith(field), (str(error), field)
    assert field_path(field), field
    if path is not None:
        assert related(field_path(field), path), (field, path, str(error))
    warning = f"skipping malformed {kind} {describe(obj)}: {error}"
    assert parse_objects([obj]).warnings == (warning,)
    assert tracker.parse(kind, obj).warning == warning


@pytest.mark.parametrize("kind", OBJECTS)
def test_the_complete_objects_parse(kind):
    _, view_type = PARSERS[kind]
    assert isinstance(PARSERS[kind][0](OBJECTS[kind]), view_type)


FIELDS = [(kind, path) for kind, obj in OBJECTS.items() for path in positions(obj)]
# One value of each shape, tried in every field (hypothesis may not draw each one there).
EDGES = [ABSENT, None, True, False, 0, -1, 80, 2**64, 1.5, float("nan"), "", "x", "²", "٣",
         "80", "10.96.0.10", "fd00::1", "10.0.0.1\x00", [], [None], ["x"], [{}], {}, {1: "x"},
         {"x": 1}, {"ip": None}, b"\x00", dt.date(2024, 1, 1), {"a"}]  # fmt: skip


@pytest.mark.parametrize("value", EDGES, ids=repr)
def test_every_shape_in_every_field_is_a_view_or_a_warning_naming_the_field(value):
    for kind, path in FIELDS:
        check(kind, substituted(OBJECTS[kind], path, value), path)


@pytest.mark.parametrize(
    ("kind", "path"), FIELDS, ids=[f"{kind}:{'.'.join(map(str, p))}" for kind, p in FIELDS]
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.just(ABSENT) | VALUES)
def test_any_value_in_any_field_is_a_view_or_a_warning_naming_the_field(kind, path, value):
    check(kind, substituted(OBJECTS[kind], path, value), path)


# Whole objects of random shape, built from the parser's own field names so that the random
# trees reach deep (a `spec` holding `ports` holding objects with `port`...).
SHAPES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=25,
)


@pytest.mark.parametrize("kind", OBJECTS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(KEYS, SHAPES, max_size=6))
def test_an_object_of_any_shape_is_a_view_or_a_warning_naming_a_field(kind, body):
    check(kind, {**body, "kind": kind}, None)


@settings(max_examples=200, deadline=None)
@given(objects=st.lists(VALUES, max_size=4))
def test_parse_objects_takes_any_list_of_values(objects):
    parsed = parse_objects(objects)  # nothing with a kind: ignored
    assert parsed == Parsed()


@settings(max_examples=100, deadline=None)
@given(obj=VALUES, event=st.sampled_from(["ADDED", "MODIFIED", "DELETED"]))
def test_the_tracker_takes_any_event_object(obj, event):
    """A watch event's object is whatever the API server sent: never an exception."""
    store = tracker.Tracker()
    for kind in OBJECTS:
        store.event(kind, event, obj)
        assert not store.views(kind)
    if not isinstance(obj, dict) and event != "DELETED":
        got = type(obj).__name__
        want = tuple(f"skipping {kind}: expected an object, got {got}" for kind in OBJECTS)
        assert store.take().warnings == want


# ---- JSON text: the fast path (sync/wire.py) against the decoded object ------------------
#
# SLICE's endpoint has topology hints, which the fast path leaves to api.py: these slices
# have none, and endpoints with every condition absent, null or set, so that the fast path
# itself meets every value in every field.

PLAIN_SLICE: dict[str, Any] = {
    **SLICE,
    "endpoints": [
        {"addresses": ["10.244.0.1"], "conditions": {"ready": True}, "nodeName": "node-a"},
        {"addresses": ["10.244.0.2", "10.244.0.3"], "conditions": {"serving": None}},
        {"addresses": ["10.244.0.4"], "hints": None, "nodeName": ""},
        {
            "addresses": ["10.244.0.5"],
            "conditions": {"ready": False, "serving": True, "terminating": True},
            "targetRef": {"kind": "Pod", "name": "web-1"},
        },
    ],
}
FAST = {"Service": SERVICE, "EndpointSlice": PLAIN_SLICE}
FAST_FIELDS = [(kind, path) for kind, obj in FAST.items() for path in positions(obj)]


@pytest.mark.parametrize("kind", FAST)
def test_the_fast_path_takes_the_complete_objects(kind):
    """Else the tests below would only compare the ordinary path with itself."""
    fast = wire.parsed_json(kind, json.dumps(FAST[kind]).encode())
    assert fast is not None
    assert fast[1] == PARSERS[kind][0](FAST[kind])


@pytest.mark.parametrize("value", EDGES, ids=repr)
def test_every_shape_in_every_field_parses_from_json_as_decoded(value):
    for kind, path in FAST_FIELDS:
        same_from_json(kind, substituted(FAST[kind], path, value))


@pytest.mark.parametrize(
    ("kind", "path"),
    FAST_FIELDS,
    ids=[f"{kind}:{'.'.join(map(str, p))}" for kind, p in FAST_FIELDS],
)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.just(ABSENT) | VALUES)
def test_any_value_in_any_field_parses_from_json_as_decoded(kind, path, value):
    same_from_json(kind, substituted(FAST[kind], path, value))


@pytest.mark.parametrize("text", [b"{", b"[" * 100_000 + b"]" * 100_000, b"5", b'"x"'])
def test_json_text_that_is_no_object_is_a_warning(text):
    parsed = tracker.parse("Service", RawJson("Service", text))
    assert parsed.view is None
    assert parsed.warning.startswith("skipping Service: ")
