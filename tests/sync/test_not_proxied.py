"""Objects a proxy must not see: kube-proxy lists and watches Services and EndpointSlices
with the selector `!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`
(cmd/kube-proxy/app/server.go), so such an object is not there for it, and a label added is a
deletion. The e2e spec "should implement service.kubernetes.io/headless" labels a Service's
only EndpointSlice and expects the Service to stop answering."""

from __future__ import annotations

from ipvsproxy.config import Config
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, service, slice_

CONFIG = Config(node_name="node-a")
NAME = {"kubernetes.io/service-name": "web"}


def destinations(kernel: FakeKernel) -> dict[str, set[str]]:
    return {
        str(key.address): {str(rs.address) for rs in dests}
        for key, dests in kernel.state.dests.items()
    }


def test_a_slice_labelled_headless_leaves_its_service_as_a_deletion_would_and_comes_back():
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node()])
    tracker.replace(SERVICE, [service("web", cluster_ips=("10.96.0.10",))])
    tracker.replace(SLICE, [slice_("web", endpoints=[ep("10.244.0.5")])])
    kernel = FakeKernel()
    proxier = Proxier(kernel=kernel, config=CONFIG)
    proxier.sync(tracker.take(), full=True)
    assert destinations(kernel) == {"10.96.0.10": {"10.244.0.5"}}
    for label in ("service.kubernetes.io/headless", "service.kubernetes.io/service-proxy-name"):
        labelled = slice_("web", endpoints=[ep("10.244.0.5")], labels={**NAME, label: ""})
        tracker.event(SLICE, "MODIFIED", labelled)
        proxier.sync(tracker.take(), full=False)
        assert destinations(kernel) == {"10.96.0.10": set()}, label  # as with no slice
        tracker.event(SLICE, "MODIFIED", slice_("web", endpoints=[ep("10.244.0.5")]))
        proxier.sync(tracker.take(), full=False)
        assert destinations(kernel) == {"10.96.0.10": {"10.244.0.5"}}, label


def test_a_service_labelled_headless_gets_no_virtual_server():
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node()])
    labelled = {"service.kubernetes.io/headless": ""}
    tracker.replace(SERVICE, [service("web", cluster_ips=("10.96.0.10",), labels=labelled)])
    tracker.replace(SLICE, [slice_("web", endpoints=[ep("10.244.0.5")])])
    kernel = FakeKernel()
    Proxier(kernel=kernel, config=CONFIG).sync(tracker.take(), full=True)
    assert kernel.state.services == {}
