"""The one object parser: any value in any field gives a view or a warning, never an exception.

`api.read()` promises: an object whose fields have the wrong shape or an invalid value is
skipped with a warning that names the object and the field; nothing is raised, whatever JSON
(or YAML: dates, sets, binary) a field holds. First the shapes operators met (`diff
--manifests`), then hypothesis puts arbitrary values into every field the parser reads, and
checks that an object's JSON text (a JSON manifest's List item) reads as its decoded form.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipvsproxy.api import (
    EndpointSliceView,
    NodeView,
    Parsed,
    RawJson,
    ServiceView,
    describe,
    parse_objects,
    read,
)
from ipvsproxy.cli import main
from ipvsproxy.sync import tracker
from tests.factories import ep, node, port, service, slice_

# ---- the shapes operators met ------------------------------------------------------------


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
        "Service default/web: status.loadBalancer.ingress: expected a list, got number",
    ),
    "endpoint conditions a list": (
        slice_(endpoints=[{"addresses": ["10.244.0.1"], "conditions": [{"ready": True}]}]),
        "EndpointSlice default/web-abcde: endpoints[0].conditions: expected an object, got list",
    ),
    "targetPort a non-ASCII digit": (
        service("web", ports=[port(target="²")]),
        "Service default/web: spec.ports[0].targetPort '²' is neither a port number nor a name",
    ),
    "a condition as a string": (
        slice_(endpoints=[{"addresses": ["10.244.0.1"], "conditions": {"ready": "false"}}]),
        "EndpointSlice default/web-abcde: endpoints[0].conditions.ready: "
        "expected true, false or null, got str",
    ),
    "a source range as a number": (
        _lb(loadBalancerSourceRanges=[5]),
        "Service default/web: spec.loadBalancerSourceRanges[0]: expected a string, got number",
    ),
    "a scoped IPv6 cluster IP": (
        service("web", cluster_ips=("fe80::1%eth0",)),
        "Service default/web: spec.clusterIPs[0] 'fe80::1%eth0' is not an IP address",
    ),
    "nodePort false (not 'none allocated')": (
        service("web", type="NodePort", ports=[port(node_port=False)]),
        "Service default/web: spec.ports[0].nodePort: expected an integer, got bool",
    ),
    "a pod CIDR as a number": (
        {**node("node-a"), "spec": {"podCIDRs": [10]}},
        "Node node-a: spec.podCIDRs[0]: expected a string, got number",
    ),
    "a label key not a string (YAML)": (
        service("web", labels={1: "x"}),
        "Service default/web: metadata.labels: has a key that is not a string, got number",
    ),
    "a label value a date (YAML)": (
        service("web", labels={"day": dt.date(2024, 1, 1)}),
        "Service default/web: metadata.labels[...]: expected a string, got date",
    ),
}


@pytest.mark.parametrize(("obj", "warning"), REGRESSIONS.values(), ids=REGRESSIONS.keys())
def test_a_wrongly_shaped_field_is_a_warning_naming_object_and_field(obj, warning):
    good = service("other", cluster_ips=("10.96.0.99",))
    parsed = parse_objects([obj, good])
    assert parsed.warnings == (f"skipping malformed {warning}",)
    assert [s.name for s in parsed.services] == ["other"]


def test_a_value_shared_a_billion_times_is_named_briefly():
    """YAML aliases make a few lines a tree of 9**30 leaves; its repr would never end."""
    bomb: list[Any] = ["lol"]
    for _ in range(30):
        bomb = [bomb] * 9
    obj = service("web", ports=[{"port": bomb}])
    (warning,) = parse_objects([obj]).warnings
    assert warning.startswith("skipping malformed Service default/web: spec.ports[0].port: ")
    assert len(warning) < 300
    obj = service("web", ns=bomb)
    obj["metadata"]["name"] = bomb
    (warning,) = parse_objects([obj]).warnings
    assert warning.startswith("skipping malformed Service [[[")
    assert len(warning) < 600


def test_nesting_past_the_recursion_limit_is_a_warning():
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    (warning,) = parse_objects([service("web", externalIPs=deep)]).warnings
    assert warning.startswith("skipping malformed Service default/web: spec.externalIPs[0]")
    deep_text = b"[" * 100_000 + b"]" * 100_000
    for kind, where in (("Node", b"deletionTimestamp"), ("Service", b"managedFields")):
        text = b'{"metadata": {"name": "n", "%s": %s}}' % (where, deep_text)
        got = read(kind, RawJson(kind, text))
        assert got.view is None
        assert got.warning.startswith(f"skipping malformed {kind} "), got.warning


@pytest.mark.parametrize(("obj", "warning"), list(REGRESSIONS.values())[:5])
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


# ---- every field, any value -------------------------------------------------------------
#
# Complete objects that use every field the parser reads. Each case picks one position in
# such an object (a field, a list item, or a whole subtree such as `spec.ports[0]`), puts an
# arbitrary value there or deletes it, and reads the object as a dict and as JSON text.

SERVICE: dict[str, Any] = {
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
        "healthCheckNodePort": 32000,
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
        "loadBalancerSourceRanges": ["203.0.113.0/24"],
    },
    "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.10", "ipMode": "VIP"}]}},
}
SLICE: dict[str, Any] = {
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
        },
        {"addresses": ["10.244.0.2", "10.244.0.3"], "conditions": {"serving": None}},
    ],
}
NODE: dict[str, Any] = {
    "kind": "Node",
    "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "a"}},
    "spec": {
        "podCIDR": "10.244.0.0/24",
        "podCIDRs": ["10.244.0.0/24", "fd00:244::/64"],
        "taints": [{"key": "ToBeDeletedByClusterAutoscaler"}],
    },
    "status": {
        "addresses": [
            {"type": "InternalIP", "address": "192.168.0.10"},
            {"type": "Hostname", "address": "node-a"},
        ]
    },
}
OBJECTS = {"Service": SERVICE, "EndpointSlice": SLICE, "Node": NODE}
VIEWS = {"Service": ServiceView, "EndpointSlice": EndpointSliceView, "Node": NodeView}

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
    | WORDS
)
# what YAML manifests add to JSON's types (PyYAML's SafeLoader: !!timestamp, !!binary, !!set)
YAML_SCALARS = st.dates() | st.datetimes() | st.binary(max_size=8)
KEYS = st.sampled_from(sorted({str(p[-1]) for o in OBJECTS.values() for p in positions(o)}))
VALUES = st.recursive(
    SCALARS | YAML_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(KEYS | st.text(max_size=5) | st.integers(), inner, max_size=4)
        | st.frozensets(SCALARS.filter(lambda v: v == v), max_size=3)  # !!set; NaN != NaN
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


def check(kind: str, obj: dict[str, Any]) -> None:
    """A view, or a warning naming the object (and then the field); from its JSON text, the
    same as from the text's decoded form."""
    got = read(kind, obj)
    if got.view is not None:
        assert isinstance(got.view, VIEWS[kind])
        assert got.warning == ""
        assert parse_objects([obj]).warnings == ()
    else:
        named = f"skipping malformed {kind} {describe(obj.get('metadata'))}: "
        assert got.warning.startswith(named), got.warning
        assert got.warning[len(named) :], got.warning
        assert parse_objects([obj]).warnings == (got.warning,)
    try:
        text = json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError, RecursionError):  # YAML's dates, bytes and sets; NaN
        return
    assert read(kind, RawJson(kind, text.encode())) == read(kind, json.loads(text))


@pytest.mark.parametrize("kind", OBJECTS)
def test_the_complete_objects_read(kind):
    got = read(kind, OBJECTS[kind])
    assert isinstance(got.view, VIEWS[kind]), got.warning
    assert got == read(kind, RawJson(kind, json.dumps(OBJECTS[kind]).encode()))


FIELDS = [(kind, path) for kind, obj in OBJECTS.items() for path in positions(obj)]
# One value of each shape, tried in every field (hypothesis may not draw each one there).
EDGES = [ABSENT, None, True, False, 0, -1, 80, 2**64, 1.5, float("nan"), "", "x", "²", "٣",
         "80", "10.96.0.10", "fd00::1", "10.0.0.1\x00", [], [None], ["x"], [{}], {}, {1: "x"},
         {"x": 1}, {"ip": None}, b"\x00", dt.date(2024, 1, 1), {"a"}]  # fmt: skip


@pytest.mark.parametrize("value", EDGES, ids=repr)
def test_every_shape_in_every_field_is_a_view_or_a_warning(value):
    for kind, path in FIELDS:
        check(kind, substituted(OBJECTS[kind], path, value))


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=st.just(ABSENT) | VALUES)
def test_any_value_in_any_field_is_a_view_or_a_warning(field, value):
    kind, path = field
    check(kind, substituted(OBJECTS[kind], path, value))


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
def test_an_object_of_any_shape_is_a_view_or_a_warning(kind, body):
    check(kind, {**body, "kind": kind})


@settings(max_examples=200, deadline=None)
@given(objects=st.lists(VALUES, max_size=4))
def test_parse_objects_takes_any_list_of_values(objects):
    assert parse_objects(objects) == Parsed()  # nothing with a kind: ignored


@settings(max_examples=100, deadline=None)
@given(obj=VALUES, event=st.sampled_from(["ADDED", "MODIFIED", "DELETED"]))
def test_the_tracker_takes_any_event_object(obj, event):
    """A watch event's object is whatever the API server sent: never an exception."""
    store = tracker.Tracker()
    for kind in OBJECTS:
        store.event(kind, event, obj)
        assert not store.views(kind)
    if not isinstance(obj, dict) and event != "DELETED":
        got = "null" if obj is None else type(obj).__name__
        want = tuple(f"skipping {kind}: expected an object, got {got}" for kind in OBJECTS)
        assert store.take().warnings == want


@pytest.mark.parametrize("text", [b"{", b"[" * 100_000 + b"]" * 100_000, b"5", b'"x"', b"\xff"])
def test_json_text_that_is_no_object_is_a_warning(text):
    parsed = read("Service", RawJson("Service", text))
    assert parsed.view is None
    assert parsed.warning.startswith("skipping Service: ")


def test_an_endpoints_pod_and_zone_are_kept_for_status():
    from tests.factories import ep, parse_slice, slice_

    pod = {**ep("10.244.1.1"), "targetRef": {"kind": "Pod", "name": "web-7d9f", "uid": "x"}}
    other = {**ep("10.244.1.2"), "targetRef": {"kind": "VirtualMachine", "name": "vm-1"}}
    zoned = {**ep("10.244.1.3"), "zone": "zone-a"}
    got = parse_slice(slice_(endpoints=[pod, other, zoned])).endpoints
    assert [(e.pod, e.zone) for e in got] == [
        ("web-7d9f", ""),
        ("VirtualMachine/vm-1", ""),
        ("", "zone-a"),
    ]


@pytest.mark.parametrize(
    "conditions",
    [ABSENT, {}, {"ready": None}, {"ready": None, "serving": None}],
    ids=["no conditions", "empty", "ready null", "both null"],
)
def test_an_endpoint_whose_ready_is_missing_or_null_is_ready(conditions):
    """discovery/v1: "a nil value should be interpreted as true" (kube-proxy reads it so)."""
    endpoint: dict[str, Any] = {"addresses": ["10.244.0.1"]}
    if conditions is not ABSENT:
        endpoint["conditions"] = conditions
    got = read("EndpointSlice", slice_(endpoints=[endpoint]))
    assert isinstance(got.view, EndpointSliceView), got.warning
    (view,) = got.view.endpoints
    assert (view.ready, view.serving) == (True, True)
