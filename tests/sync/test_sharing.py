"""Memory stays flat under churn: a changed slice keeps the old version's objects for its
unchanged endpoints (tracker), and a changed Service's translation keeps the destinations
the desired table already holds (proxier), so the desired table, the kernel's table and the
views share one object per endpoint however many times each Service changed (the 10,000-
Service soak grew by a quarter in 3 minutes before: bench/native_scale.py)."""

from __future__ import annotations

import random
from typing import Any

from ipvsproxy.api import EndpointSliceView
from ipvsproxy.config import Config
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, service, slice_

CONFIG = Config(node_name="node-a", min_sync_period=0.0)


def endpoints(i: int, pods: list[int]) -> Any:
    return slice_(
        f"s{i}", endpoints=[ep(f"10.{100 + p // 65536}.{p // 256 % 256}.{p % 256}") for p in pods]
    )


def test_every_endpoint_is_one_object_however_often_its_service_changed():
    services = 40
    pods = {i: list(range(i * 10, i * 10 + 10)) for i in range(services)}
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node()])
    tracker.replace(
        SERVICE, [service(f"s{i}", cluster_ips=(f"10.96.0.{i + 1}",)) for i in range(services)]
    )
    tracker.replace(SLICE, [endpoints(i, pods[i]) for i in range(services)])
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=CONFIG)
    proxier.sync(tracker.take(), full=True)
    rng, fresh = random.Random(7), 100_000
    for n in range(400):  # rollout steps: one endpoint of one Service replaced at a time
        i = rng.randrange(services)
        pods[i][rng.randrange(10)] = fresh + n
        tracker.event(SLICE, "MODIFIED", endpoints(i, pods[i]))
        proxier.sync(tracker.take(), full=n % 50 == 49)
    desired = {id(rs) for dests in proxier.index.dests.values() for rs in dests.values()}
    programmed = {id(rs) for dests in kernel.state.dests.values() for rs in dests.values()}
    assert len(desired) == services * 10
    assert programmed == desired  # one object each, shared by both tables
    views = tracker.views(SLICE)
    addresses = {id(e.address) for v in views for e in v.endpoints}  # type: ignore[union-attr]
    keys = {id(rs.key.address) for d in proxier.index.dests.values() for rs in d.values()}
    assert len(addresses) == services * 10
    assert addresses == keys  # the views' and the tables' addresses are the same objects


def test_a_services_change_keeps_the_key_objects_already_held():
    """The first change of each Service used to leave second copies of its keys behind: the
    new slice's namespace and name strings (the tracker's and the index's maps keep their
    old key objects) and the Service's ref tuple (the index popped and re-inserted it). At
    10,000 Services that was a few % of the heap once every Service had changed."""
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node()])
    tracker.replace(
        SERVICE, [service(f"s{i}", cluster_ips=(f"10.96.0.{i + 1}",)) for i in range(3)]
    )
    tracker.replace(SLICE, [endpoints(i, [i * 10]) for i in range(3)])
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=CONFIG)
    proxier.sync(tracker.take(), full=True)

    def held() -> dict[tuple[str, str], tuple[Any, ...]]:
        slices = [v for v in tracker.views(SLICE) if isinstance(v, EndpointSliceView)]
        views = {(v.namespace, v.name): v for v in slices}
        refs = {ref: ref for ref in proxier.index._contributions}  # the map's own keys
        return {
            key: (view.namespace, view.name, view.service_name, refs[(key[0], view.service_name)])
            for key, view in views.items()
        }

    before = held()
    for i in range(3):
        tracker.event(SLICE, "MODIFIED", endpoints(i, [i * 10, 99]))
    proxier.sync(tracker.take(), full=False)
    after = held()
    assert after == before
    assert all(a is b for key in before for a, b in zip(after[key], before[key], strict=True))
