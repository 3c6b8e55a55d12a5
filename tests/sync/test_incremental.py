"""The incremental path equals the full path.

Random sequences of object changes (Services of every type sharing a small pool of addresses,
so they collide; EndpointSlices moving between Services; the Node changing) go through the
Tracker into a Proxier over FakeKernel, synced partially or fully at random. After every
pass with no drift pending, the kernel holds exactly what a from-scratch translation of the
final objects asks for; drift injected behind the proxier's back is repaired by the next
full pass (and only then: a partial pass reads nothing from the kernel).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipvsproxy.api import EndpointSliceView, NodeView, ServiceView
from ipvsproxy.config import Config
from ipvsproxy.model import DeleteService, IpvsState
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.desired_index import DesiredIndex
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import desired_state, node, parse_node, parse_service
from tests.strategies import NAMES, nodes, services, slices

CONFIG = Config(node_name="node-a", min_sync_period=0.0)
steps = st.lists(
    st.one_of(
        st.tuples(st.just(SERVICE), st.sampled_from(["MODIFIED", "DELETED"]), services()),
        st.tuples(st.just(SLICE), st.sampled_from(["MODIFIED", "DELETED"]), slices()),
        st.tuples(st.just(NODE), st.just("MODIFIED"), nodes()),
        st.tuples(st.just("sync"), st.sampled_from(["partial", "full"]), st.none()),
        st.tuples(st.just("drift"), st.none(), st.none()),
    ),
    max_size=30,
)


def from_scratch(tracker: Tracker) -> IpvsState:
    nodes = [n for n in tracker.views(NODE) if isinstance(n, NodeView)]
    return desired_state(
        [v for v in tracker.views(SERVICE) if isinstance(v, ServiceView)],
        [v for v in tracker.views(SLICE) if isinstance(v, EndpointSliceView)],
        next((n for n in nodes if n.name == CONFIG.node_name), parse_node(node())),
        CONFIG,
    ).state


def same(kernel: FakeKernel, want: IpvsState) -> bool:
    got = kernel.state
    return (got.services, got.dests, got.bound) == (want.services, want.dests, want.bound)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_partial_and_full_passes_reach_what_a_fresh_translation_asks(script):
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    for kind, obj in ((SERVICE, []), (SLICE, []), (NODE, [node()])):
        tracker.replace(kind, obj)
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=CONFIG)
    proxier.sync(tracker.take(), full=True)
    drifted = stale = False
    for kind, how, obj in script:
        if kind == "sync":
            result = proxier.sync(tracker.take(), full=how == "full" or stale)
            stale = result.stale  # the kernel contradicted the table: the daemon goes full
            drifted = drifted and how == "partial"
            if not drifted:
                assert result.sync.report.ok
                assert same(kernel, from_scratch(tracker))
                table = proxier.table  # what the next partial pass plans against
                held = kernel.state
                assert (table.services, table.dests, table.bound) == (
                    dict(held.services),
                    {key: dict(dests) for key, dests in held.dests.items()},
                    set(held.bound),
                )
        elif kind == "drift":  # someone deletes one of our virtual servers
            victim = next(iter(kernel.state.services), None)
            if victim is not None:
                kernel.apply([DeleteService(victim)])
                drifted = True
        else:
            tracker.event(kind, how, obj)
    proxier.sync(tracker.take(), full=True)
    assert same(kernel, from_scratch(tracker))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), st.one_of(st.none(), services())), max_size=25))
def test_the_index_updated_one_service_at_a_time_equals_a_fresh_one(updates):
    from ipvsproxy.sync.desired import translate_service

    node_view = parse_node(node())
    index = DesiredIndex()
    current: dict[str, Any] = {}
    for name, obj in updates:
        view = parse_service(obj) if obj is not None else None
        if view is not None:
            name = view.name
        current[name] = view
        contribution = translate_service(view, (), node_view, CONFIG) if view else None
        index.update(("default", name), contribution)
    fresh = desired_state([v for v in current.values() if v], [], node_view, CONFIG)
    got = index.desired()
    assert got.state == fresh.state
    assert got.origins == fresh.origins
    assert got.access == fresh.access
    assert sorted(got.warnings) == sorted(fresh.warnings)
    assert index.dest_count == sum(map(len, fresh.state.dests.values()))
