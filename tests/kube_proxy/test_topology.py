"""kube-proxy's own table `TestCategorizeEndpoints` (pkg/proxy/topology_test.go) run against
`categorize_endpoints()`: endpoints' `hints.forNodes` / `hints.forZones` against this node's
name and `topology.kubernetes.io/zone` label, traffic policies, terminating fallbacks, as
kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology.go) sorts them.
"""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

import pytest

from ipvsproxy.api import EndpointView, NodeView
from ipvsproxy.sync.desired import categorize_endpoints

HOST = "test-hostname"


def E(
    address: str,
    *,
    zones: tuple[str, ...] = (),
    nodes: tuple[str, ...] = (),
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
    local: bool = False,
) -> EndpointView:
    """kube-proxy's BaseEndpointInfo: `IsLocal` is the node name being this node's."""
    return EndpointView(
        ip_address(address),
        ready=ready,
        serving=ready if serving is None else serving,
        terminating=terminating,
        node_name=HOST if local else "other-host",
        zone_hints=frozenset(zones),
        node_hints=frozenset(nodes),
    )


def A(*e: EndpointView) -> list[EndpointView]:
    return list(e)


# kube-proxy's BaseServicePort flags as our two: (cluster used, local used). A Service that
# is not externally accessible has eTP ignored (kube-proxy's ExternallyAccessible).
CLUSTER = (True, False)  # iTP Cluster (eTP Cluster, or eTP Local and not external)
ITP_LOCAL_ONLY = (False, True)  # iTP Local, not externally accessible
BOTH = (True, True)  # eTP Local and a node port, or iTP Local and a node port
ZONE_A = {"topology.kubernetes.io/zone": "zone-a"}

# name: (node labels, (cluster used, local used), endpoints, cluster, local, has any)
# None: that set is never used. Addresses stand for kube-proxy's "ip:80" strings.
CATEGORIZE: dict[str, tuple[Any, ...]] = {
    "should use topology since all endpoints have hints, node has a zone label and there "
    "are endpoints for the node's zone": (
        ZONE_A,
        CLUSTER,
        A(
            E("10.1.2.3", zones=("zone-a",)),
            E("10.1.2.4", zones=("zone-b",)),
            E("10.1.2.5", zones=("zone-c",)),
            E("10.1.2.6", zones=("zone-a",)),
        ),
        {"10.1.2.3", "10.1.2.6"},
        None,
        True,
    ),
    "externalTrafficPolicy: Local, topology ignored for Local endpoints": (
        ZONE_A,
        BOTH,
        A(
            E("10.1.2.3", zones=("zone-a",), local=True),
            E("10.1.2.4", zones=("zone-b",), local=True),
            E("10.1.2.5", zones=("zone-c",)),
            E("10.1.2.6", zones=("zone-a",)),
        ),
        {"10.1.2.3", "10.1.2.6"},
        {"10.1.2.3", "10.1.2.4"},
        True,
    ),
    "internalTrafficPolicy: Local, topology ignored for Local endpoints": (
        ZONE_A,
        BOTH,  # iTP Local with a node port: the cluster set is used too
        A(
            E("10.1.2.3", zones=("zone-a",), local=True),
            E("10.1.2.4", zones=("zone-b",), local=True),
            E("10.1.2.5", zones=("zone-c",)),
            E("10.1.2.6", zones=("zone-a",)),
        ),
        {"10.1.2.3", "10.1.2.6"},
        {"10.1.2.3", "10.1.2.4"},
        True,
    ),
    "empty node labels": (
        {},
        CLUSTER,
        A(E("10.1.2.3", zones=("zone-a",))),
        {"10.1.2.3"},
        None,
        True,
    ),
    "empty zone label": (
        {"topology.kubernetes.io/zone": ""},
        CLUSTER,
        A(E("10.1.2.3", zones=("zone-a",))),
        {"10.1.2.3"},
        None,
        True,
    ),
    "node in different zone, no endpoint filtering": (
        {"topology.kubernetes.io/zone": "zone-b"},
        CLUSTER,
        A(E("10.1.2.3", zones=("zone-a",))),
        {"10.1.2.3"},
        None,
        True,
    ),
    "unready endpoint": (
        ZONE_A,
        CLUSTER,
        A(
            E("10.1.2.3", zones=("zone-a",)),
            E("10.1.2.4", zones=("zone-b",)),
            E("10.1.2.5", zones=("zone-c",)),
            E("10.1.2.6", zones=("zone-a",), ready=False),
        ),
        {"10.1.2.3"},
        None,
        True,
    ),
    "only unready endpoints in same zone (should not filter)": (
        ZONE_A,
        CLUSTER,
        A(
            E("10.1.2.3", zones=("zone-a",), ready=False),
            E("10.1.2.4", zones=("zone-b",)),
            E("10.1.2.5", zones=("zone-c",)),
            E("10.1.2.6", zones=("zone-a",), ready=False),
        ),
        {"10.1.2.4", "10.1.2.5"},
        None,
        True,
    ),
    "missing hints, no filtering applied": (
        ZONE_A,
        CLUSTER,
        A(
            E("10.1.2.3", zones=("zone-a",)),
            E("10.1.2.4", zones=("zone-b",)),
            E("10.1.2.5"),
            E("10.1.2.6", zones=("zone-a",)),
        ),
        {"10.1.2.3", "10.1.2.4", "10.1.2.5", "10.1.2.6"},
        None,
        True,
    ),
    "multiple hints per endpoint, filtering includes any endpoint with zone included": (
        {"topology.kubernetes.io/zone": "zone-c"},
        CLUSTER,
        A(
            E("10.1.2.3", zones=("zone-a", "zone-b", "zone-c")),
            E("10.1.2.4", zones=("zone-b", "zone-c")),
            E("10.1.2.5", zones=("zone-b", "zone-d")),
            E("10.1.2.6", zones=("zone-c",)),
        ),
        {"10.1.2.3", "10.1.2.4", "10.1.2.6"},
        None,
        True,
    ),
    "conflicting topology and localness require merging allEndpoints": (
        ZONE_A,
        BOTH,
        A(
            E("10.0.0.0", zones=("zone-a",), local=True),
            E("10.0.0.1", zones=("zone-b",), local=True),
            E("10.0.0.2", zones=("zone-a",)),
            E("10.0.0.3", zones=("zone-b",)),
        ),
        {"10.0.0.0", "10.0.0.2"},
        {"10.0.0.0", "10.0.0.1"},
        True,
    ),
    "internalTrafficPolicy: Local, with empty endpoints": (
        {},
        ITP_LOCAL_ONLY,
        A(),
        None,
        set(),
        False,
    ),
    "internalTrafficPolicy: Local, but all endpoints are remote": (
        {},
        ITP_LOCAL_ONLY,
        A(E("10.0.0.0"), E("10.0.0.1")),
        None,
        set(),
        True,  # onlyRemoteEndpoints
    ),
    "internalTrafficPolicy: Local, all endpoints are local": (
        {},
        ITP_LOCAL_ONLY,
        A(E("10.0.0.0", local=True), E("10.0.0.1", local=True)),
        None,
        {"10.0.0.0", "10.0.0.1"},
        True,
    ),
    "internalTrafficPolicy: Local, some endpoints are local": (
        {},
        ITP_LOCAL_ONLY,
        A(E("10.0.0.0", local=True), E("10.0.0.1")),
        None,
        {"10.0.0.0"},
        True,
    ),
    "Cluster traffic policy, endpoints not Ready": (
        {},
        CLUSTER,
        A(E("10.0.0.0", ready=False), E("10.0.0.1", ready=False)),
        set(),
        None,
        False,
    ),
    "Cluster traffic policy, some endpoints are Ready": (
        {},
        CLUSTER,
        A(E("10.0.0.0", ready=False), E("10.0.0.1")),
        {"10.0.0.1"},
        None,
        True,
    ),
    "Cluster traffic policy, all endpoints are terminating": (
        {},
        CLUSTER,
        A(
            E("10.0.0.0", ready=False, serving=True, terminating=True, local=True),
            E("10.0.0.1", ready=False, serving=True, terminating=True),
        ),
        {"10.0.0.0", "10.0.0.1"},
        None,
        True,
    ),
    "iTP: Local, eTP: Cluster, some endpoints local": (
        {},
        BOTH,
        A(E("10.0.0.0", local=True), E("10.0.0.1")),
        {"10.0.0.0", "10.0.0.1"},
        {"10.0.0.0"},
        True,
    ),
    "iTP: Cluster, eTP: Local, some endpoints local": (
        {},
        BOTH,
        A(E("10.0.0.0", local=True), E("10.0.0.1")),
        {"10.0.0.0", "10.0.0.1"},
        {"10.0.0.0"},
        True,
    ),
    "iTP: Local, eTP: Local, all endpoints remote": (
        {},
        BOTH,
        A(E("10.0.0.0"), E("10.0.0.1")),
        {"10.0.0.0", "10.0.0.1"},
        set(),
        True,
    ),
    "iTP: Local, eTP: Local, all endpoints remote and terminating": (
        {},
        BOTH,
        A(
            E("10.0.0.0", ready=False, serving=True, terminating=True),
            E("10.0.0.1", ready=False, serving=True, terminating=True),
        ),
        {"10.0.0.0", "10.0.0.1"},
        set(),
        True,
    ),
    "iTP: Cluster, eTP: Local, with terminating endpoints": (
        {},
        BOTH,
        A(
            E("10.0.0.0"),
            E("10.0.0.1", ready=False, serving=False, local=True),
            E("10.0.0.2", ready=False, serving=True, terminating=True, local=True),
            E("10.0.0.3", ready=False, serving=True, terminating=True),
        ),
        {"10.0.0.0"},
        {"10.0.0.2"},
        True,
    ),
    "externalTrafficPolicy ignored if not externally accessible": (
        {},
        CLUSTER,
        A(E("10.0.0.0"), E("10.0.0.1", local=True)),
        {"10.0.0.0", "10.0.0.1"},
        None,
        True,
    ),
    "no cluster endpoints for iTP:Local internal-only service": (
        {},
        ITP_LOCAL_ONLY,
        A(E("10.0.0.0"), E("10.0.0.1", local=True)),
        None,
        {"10.0.0.1"},
        True,
    ),
    # v1.36's PreferSameTrafficDistribution (node hints), from topologyModeFromHints
    "node hints: every ready endpoint has one and one names this node": (
        ZONE_A,
        CLUSTER,
        A(
            E("10.0.0.0", zones=("zone-a",), nodes=(HOST,)),
            E("10.0.0.1", zones=("zone-a",), nodes=("other-host",)),
            E("10.0.0.2", zones=("zone-b",), nodes=("third-host",)),
        ),
        {"10.0.0.0"},
        None,
        True,
    ),
    "node hints, none for this node: zone hints decide": (
        ZONE_A,
        CLUSTER,
        A(
            E("10.0.0.0", zones=("zone-a",), nodes=("host-0",)),
            E("10.0.0.1", zones=("zone-a",), nodes=("host-1",)),
            E("10.0.0.2", zones=("zone-b",), nodes=("host-2",)),
        ),
        {"10.0.0.0", "10.0.0.1"},
        None,
        True,
    ),
    "node hints on some ready endpoints only: zone hints decide": (
        ZONE_A,
        CLUSTER,
        A(
            E("10.0.0.0", zones=("zone-b",), nodes=(HOST,)),
            E("10.0.0.1", zones=("zone-a",)),
            E("10.0.0.2", zones=("zone-b",)),
        ),
        {"10.0.0.1"},
        None,
        True,
    ),
    "node hints: an unready endpoint without one does not count": (
        {},
        CLUSTER,
        A(E("10.0.0.0", nodes=(HOST,)), E("10.0.0.1", nodes=("x",)), E("10.0.0.2", ready=False)),
        {"10.0.0.0"},
        None,
        True,
    ),
    "node hints: a ready endpoint without one switches them off": (
        {},
        CLUSTER,
        A(E("10.0.0.0", nodes=(HOST,)), E("10.0.0.1")),
        {"10.0.0.0", "10.0.0.1"},
        None,
        True,
    ),
}


@pytest.mark.parametrize(
    ("labels", "uses", "endpoints", "cluster", "local", "has_any"),
    CATEGORIZE.values(),
    ids=CATEGORIZE.keys(),
)
def test_categorize_endpoints_as_kube_proxy(labels, uses, endpoints, cluster, local, has_any):
    backends = [(e, 80) for e in endpoints]
    got = categorize_endpoints(
        backends, NodeView(HOST, labels=labels), cluster_used=uses[0], local_used=uses[1]
    )
    assert {str(e.address) for e, _ in got.cluster} == (cluster or set())
    assert {str(e.address) for e, _ in got.local} == (local or set())
    if cluster is None:
        assert got.cluster == []
    if local is None:
        assert got.local == []
    assert got.has_any is has_any
