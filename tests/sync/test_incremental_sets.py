"""The firewall's sets on the incremental path equal a from-scratch computation.

The same random object changes as test_incremental.py (Services colliding on few addresses,
slices moving between Services and endpoints between nodes, the Node changing), synced
partially or fully at random by a Proxier with the firewall on a fake ipset host. After
every full pass the host's sets are exactly `wanted()` of a fresh translation of the final
objects, whatever drift was injected into the sets and the IPVS table before it: a full pass
refreshes only what may have changed in its set index, and this is what proves it misses
nothing (this node's endpoints changing, addresses bound and unbound, drift repaired).
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipvsproxy.api import EndpointSliceView, NodeView, ServiceView
from ipvsproxy.config import Config
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.firewall.sets import wanted
from ipvsproxy.model import DeleteService, IpvsState
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import desired_state, node, parse_node
from tests.strategies import nodes, services, slices
from tests.support import FakeHost

CONFIG = Config(node_name="node-a", min_sync_period=0.0)  # as test_incremental.py's

steps = st.lists(
    st.one_of(
        st.tuples(st.just(SERVICE), st.sampled_from(["MODIFIED", "DELETED"]), services()),
        st.tuples(st.just(SLICE), st.sampled_from(["MODIFIED", "DELETED"]), slices()),
        st.tuples(st.just(NODE), st.just("MODIFIED"), nodes()),
        st.tuples(st.just("sync"), st.sampled_from(["partial", "full"]), st.none()),
        st.tuples(st.just("drift"), st.sampled_from(["ipvs", "set"]), st.integers(0, 50)),
        # the same Service with only what the firewall reads changed: no IPVS operation
        st.tuples(st.just("flip"), st.sampled_from(["local", "ranges"]), st.integers(0, 3)),
        # removed endpoints drain while connected, up to the timeout (held in the sets too)
        st.tuples(st.just("conns"), st.booleans(), st.none()),
        st.tuples(st.just("clock"), st.none(), st.none()),
    ),
    max_size=30,
)


def host_wants(tracker: Tracker, synced: IpvsState) -> dict[str, frozenset[str]]:
    """`wanted()` from scratch: the desired state's access and local endpoints, over what
    the pass asked of the kernel (the desired state plus endpoints still draining)."""
    nodes = [n for n in tracker.views(NODE) if isinstance(n, NodeView)]
    desired = desired_state(
        [v for v in tracker.views(SERVICE) if isinstance(v, ServiceView)],
        [v for v in tracker.views(SLICE) if isinstance(v, EndpointSliceView)],
        next((n for n in nodes if n.name == CONFIG.node_name), parse_node(node())),
        CONFIG,
    )
    sets = wanted(synced, desired.access, local=desired.local_endpoints)
    return {name: entries for name, (_, version, entries) in sets.sets.items() if version == 4}


def host_has(host: FakeHost) -> dict[str, frozenset[str]]:
    return {name: frozenset(entries) for name, (_, _, _, entries) in host.sets.items()}


def drift(kernel: FakeKernel, host: FakeHost, how: str, n: int) -> None:
    if how == "ipvs":  # someone deletes one of our virtual servers
        victim = next(iter(kernel.state.services), None)
        if victim is not None:
            kernel.apply([DeleteService(victim)])
        return
    filled = sorted(name for name, (_, _, _, e) in host.sets.items() if e)
    if filled:  # someone deletes an entry from one of our sets
        entries = host.sets[filled[n % len(filled)]][3]
        entries.discard(sorted(entries)[n % len(entries)])


def flip(svc: dict[str, Any], how: str) -> dict[str, Any]:
    """The Service with only its traffic policy or its source ranges changed."""
    flipped = copy.deepcopy(svc)
    spec = flipped["spec"]
    if how == "local":
        local = spec.get("externalTrafficPolicy") == "Local"
        spec["externalTrafficPolicy"] = "Cluster" if local else "Local"
    else:
        ranges = spec.get("loadBalancerSourceRanges")
        spec["loadBalancerSourceRanges"] = [] if ranges else ["192.0.2.0/24"]
    return flipped


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_full_passes_leave_exactly_the_sets_a_fresh_translation_asks(script):
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    for kind, obj in ((SERVICE, []), (SLICE, []), (NODE, [node()])):
        tracker.replace(kind, obj)
    kernel, host, now = FakeKernel(), FakeHost(), [0.0]
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    drainer = Drainer(timeout=10.0, clock=lambda: now[0])
    proxier = Proxier(kernel=kernel, config=CONFIG, firewall=firewall, drainer=drainer)
    connected = False
    stale = False
    last: dict[str, Any] = {}  # the last version of each Service sent, by name
    for kind, how, obj in [*script, ("sync", "full", None)]:
        kernel.conns = {
            key: {rs: (1 if connected else 0, 0) for rs in dests}
            for key, dests in kernel.state.dests.items()
        }
        if kind == "conns":
            connected = bool(how)
        elif kind == "clock":
            now[0] += 11.0
        elif kind == "sync":
            result = proxier.sync(tracker.take(), full=how == "full" or stale)
            stale = result.stale or bool(result.firewall_error)
            if result.full and not result.firewall_error:
                assert host_has(host) == host_wants(tracker, result.sync.state)
        elif kind == "drift":
            drift(kernel, host, how, obj)
        elif kind == "flip" and last:
            flipped = flip(last[sorted(last)[obj % len(last)]], how)
            last[flipped["metadata"]["name"]] = flipped
            tracker.event(SERVICE, "MODIFIED", flipped)
        elif kind in (SERVICE, SLICE, NODE):
            remember(last, kind, how, obj)
            tracker.event(kind, how, obj)


def remember(last: dict[str, Any], kind: str, how: str, obj: dict[str, Any]) -> None:
    """Keep the last version of each Service sent, for `flip`."""
    if kind == SERVICE and how == "DELETED":
        last.pop(obj["metadata"]["name"], None)
    elif kind == SERVICE:
        last[obj["metadata"]["name"]] = obj


def test_a_drain_that_ends_in_a_full_pass_takes_its_entries_with_it():
    """Endpoint 10.244.0.1 (this node's) backs Services a (https) and b (http). Removed
    from a, it drains there while connected: a's LOOP-BACK entry for port 8443 stays. When
    the drain ends in a full pass, with no object changed since, the entry goes."""
    from tests.factories import ep, port, service, slice_

    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    pod = ep("10.244.0.1", node="node-a")
    other = ep("10.244.0.2", node="node-a")
    ports = (("http", 8080, "TCP"), ("https", 8443, "TCP"))
    tracker.replace(NODE, [node()])
    tracker.replace(
        SERVICE,
        [
            service("a", cluster_ips=("10.96.0.1",), ports=[port("https", 443)]),
            service("b", cluster_ips=("10.96.0.2",), ports=[port("http", 80)]),
        ],
    )
    tracker.replace(
        SLICE,
        [
            slice_("a", ports=ports, endpoints=[pod, other]),
            slice_("b", ports=ports, endpoints=[pod]),
        ],
    )
    kernel, host, now = FakeKernel(), FakeHost(), [0.0]
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    drainer = Drainer(timeout=10.0, clock=lambda: now[0])
    proxier = Proxier(kernel=kernel, config=CONFIG, firewall=firewall, drainer=drainer)
    proxier.sync(tracker.take(), full=True)
    entry = "10.244.0.1,tcp:8443,10.244.0.1"
    assert entry in host.sets["IPVSPROXY-LOOP-BACK"][3]
    tracker.event(SLICE, "MODIFIED", slice_("a", ports=ports, endpoints=[other]))
    kernel.conns = {key: {rs: (1, 0) for rs in dests} for key, dests in kernel.state.dests.items()}
    result = proxier.sync(tracker.take(), full=True)
    assert result.sync.draining == 1
    assert entry in host.sets["IPVSPROXY-LOOP-BACK"][3]  # held while it drains
    now[0] += 11.0
    result = proxier.sync(tracker.take(), full=True)
    assert result.sync.released == 1
    assert entry not in host.sets["IPVSPROXY-LOOP-BACK"][3]
    assert host_has(host) == host_wants(tracker, result.sync.state)


def test_a_change_only_the_firewall_sees_reaches_the_sets_in_a_full_pass():
    """externalTrafficPolicy flipped, nothing else: no IPVS operation, yet the NodePort
    leaves the masquerade set (`NODE-PORT`), also when the next pass is a full one."""
    from tests.factories import ep, port, service, slice_

    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    svc = service("a", type="NodePort", cluster_ips=("10.96.0.1",), ports=[port("http", 80)])
    svc["spec"]["ports"][0]["nodePort"] = 30080
    tracker.replace(NODE, [node()])
    tracker.replace(SERVICE, [svc])
    tracker.replace(SLICE, [slice_("a", endpoints=[ep("10.244.0.1", node="node-a")])])
    kernel, host = FakeKernel(), FakeHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    proxier = Proxier(kernel=kernel, config=CONFIG, firewall=firewall)
    result = proxier.sync(tracker.take(), full=True)
    assert host.sets["IPVSPROXY-NODE-PORT"][3]
    tracker.event(SERVICE, "MODIFIED", flip(svc, "local"))
    result = proxier.sync(tracker.take(), full=True)
    assert not result.sync.plan
    assert not host.sets["IPVSPROXY-NODE-PORT"][3]
    assert host_has(host) == host_wants(tracker, result.sync.state)
