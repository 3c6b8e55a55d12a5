"""Why an endpoint of a Service is not programmed on this node (`explain_service`): one test
per rule of the translation, from the translation tests' own cases (test_desired.CASES,
test_topology), and a check over every translation case that each endpoint of each port is
either programmed or explained, never both, never neither.

Each test was checked by breaking the rule it guards (see the commit message).
"""

from __future__ import annotations

from typing import Any

import pytest

from ipvsproxy import api
from ipvsproxy.config import Config
from ipvsproxy.sync.desired import (
    Explanation,
    PortExplanation,
    Reason,
    Scope,
    Skipped,
    explain_service,
    translate_service,
)
from tests.factories import ep, node, port, service, slice_
from tests.sync.test_desired import CASES
from tests.sync.test_topology import ZONED, hinted, zoned_node


def explain(*objects: Any, name: str = "web", node_name: str = "node-a") -> Explanation:
    parsed = api.parse_objects(list(objects))
    (svc,) = [s for s in parsed.services if s.name == name]
    slices = [s for s in parsed.slices if s.service_name == name and s.namespace == svc.namespace]
    here = next((n for n in parsed.nodes if n.name == node_name), api.NodeView(node_name))
    return explain_service(svc, slices, here, Config(node_name=node_name))


def why(objects: list[Any], *, scope: Scope = Scope.INTERNAL, **kw: Any) -> dict[str, Reason]:
    """{address: reason} of the first port's endpoints left out of `scope`."""
    first = explain(*objects, **kw).ports[0]
    return {str(ep.address): reason for (ep, _), reason in first.left[scope]}


def test_not_ready():
    objects, _, _ = CASES["only ready endpoints"]
    assert why(objects)["10.244.1.3"] is Reason.NOT_READY


def test_not_ready_and_not_serving_while_none_is_ready():
    objects, _, _ = CASES["no ready endpoint: serving-and-terminating ones"]
    assert why(objects) == {
        "10.244.1.3": Reason.NOT_READY,  # terminating, not serving
        "10.244.1.4": Reason.NOT_READY,
        "10.244.1.5": Reason.NOT_READY,  # serving, not terminating
    }


def test_terminating_while_ready_ones_exist():
    objects, _, _ = CASES["only ready endpoints"]
    assert why(objects) == {"10.244.1.2": Reason.TERMINATING, "10.244.1.3": Reason.NOT_READY}


def test_another_node_under_external_traffic_policy_local():
    objects, _, _ = CASES["externalTrafficPolicy Local restricts external virtual servers only"]
    assert why(objects, scope=Scope.EXTERNAL) == {"10.244.2.1": Reason.OTHER_NODE}
    assert why(objects, scope=Scope.INTERNAL) == {}


def test_another_node_under_internal_traffic_policy_local():
    objects, _, _ = CASES["internalTrafficPolicy Local restricts the ClusterIP only"]
    assert why(objects, scope=Scope.INTERNAL) == {"10.244.2.1": Reason.OTHER_NODE}
    assert why(objects, scope=Scope.EXTERNAL) == {}


def test_local_policy_with_no_endpoint_here_falls_back_and_says_so():
    svc = service(type="NodePort", ports=[port(node_port=30080)], externalTrafficPolicy="Local")
    objects = [svc, slice_(endpoints=[ep("10.244.2.1", node="node-b")]), node()]
    first = explain(*objects).ports[0]
    assert first.fell_back == {Scope.EXTERNAL}
    assert first.left[Scope.EXTERNAL] == ()  # the cluster's endpoints serve it


def test_topology_zone_hint_for_another_zone():
    objects = [service(), slice_(endpoints=ZONED), zoned_node("zone-a")]
    assert why(objects) == {"10.244.2.1": Reason.TOPOLOGY_ZONE}


def test_topology_node_hint_for_another_node():
    eps = [
        hinted("10.244.1.1", ("zone-a",), ("node-a",), node="node-a"),
        hinted("10.244.2.1", ("zone-a",), ("node-b",), node="node-b"),
    ]
    objects = [service(), slice_(endpoints=eps), zoned_node("zone-a")]
    assert why(objects) == {"10.244.2.1": Reason.TOPOLOGY_NODE}


def test_the_other_ip_family():
    objects, _, _ = CASES["endpoints of the wrong family are ignored"]
    assert why(objects) == {"10.244.1.1": Reason.OTHER_FAMILY, "10.244.2.1": Reason.OTHER_FAMILY}


def test_no_port_of_the_service_ports_name_and_protocol():
    objects, _, _ = CASES["slice ports of another name or protocol do not match"]
    first = explain(*objects).ports[0]
    assert why(objects) == {"10.244.1.1": Reason.NO_PORT}
    assert [(str(e.address), n) for e, n in first.endpoints] == [("10.244.1.1", 0)]


@pytest.mark.parametrize(
    ("name", "reason"),
    [("headless", Skipped.HEADLESS), ("alias", Skipped.EXTERNAL_NAME),
     ("other", Skipped.OTHER_PROXY)],
)  # fmt: skip
def test_services_that_get_nothing_say_why(name, reason):
    objects, _, _ = CASES["headless, ExternalName and service-proxy-name Services get nothing"]
    got = explain(*objects, name=name)
    assert got.skipped is reason
    assert got.ports == ()


def test_the_explanation_is_the_translation():
    """explain_service's contribution is translate_service's, for every translation case."""
    for objects, _, _ in CASES.values():
        parsed = api.parse_objects(objects)
        here = next((n for n in parsed.nodes if n.name == "node-a"), api.NodeView("node-a"))
        for svc in parsed.services:
            slices = [s for s in parsed.slices if s.service_name == svc.name]
            config = Config(node_name="node-a")
            assert explain_service(svc, slices, here, config).contribution == (
                translate_service(svc, slices, here, config)
            )


@pytest.mark.parametrize(("objects", "config", "expected"), CASES.values(), ids=CASES.keys())
def test_every_endpoint_is_programmed_or_explained(objects, config, expected):
    """For each scope of each port: programmed in its virtual servers, or left out with a
    reason; never both, never neither."""
    del config, expected
    parsed = api.parse_objects(objects)
    for svc in parsed.services:
        got = explain(*objects, name=svc.name)
        for explained in got.ports:
            for scope, left in explained.left.items():
                programmed = _programmed(got, explained, scope)
                out = {(e.address, n) for (e, n), _ in left}
                every = {(e.address, n) for e, n in explained.endpoints}
                assert not programmed & out
                assert programmed | out == every, (svc.name, scope)


def _programmed(got: Explanation, explained: PortExplanation, scope: Scope) -> set[Any]:
    external = {
        key
        for key, entry in got.contribution.entries.items()
        if entry.origin == explained.origin and entry.access.reach.value != "cluster-ip"
    }
    keys = [
        key
        for key, entry in got.contribution.entries.items()
        if entry.origin == explained.origin and (key in external) == (scope is Scope.EXTERNAL)
    ]
    out: set[Any] = set()
    for key in keys:
        out |= {(rs.address, rs.port) for rs in got.contribution.entries[key].dests}
    return out
