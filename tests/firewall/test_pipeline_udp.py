"""The proxier forgets UDP flows that cached a black hole (issue 15 item 9): when a UDP
virtual server gets its first endpoint in a partial pass, its flows are deleted in the same
single `conntrack -R -` batch as those of removed endpoints."""

from __future__ import annotations

from ipvsproxy.config import Config
from ipvsproxy.firewall.kernel import Firewall
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, port, service, slice_
from tests.support import FakeHost

CONFIG = Config(node_name="node-a")


def test_a_udp_service_s_first_endpoint_forgets_its_flows_in_one_batch():
    dns = service("dns", cluster_ips=("10.96.0.53",), ports=[port("dns", 53, "UDP", 5353)])
    ports = (("dns", 5353, "UDP"),)
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node()])
    tracker.replace(SERVICE, [dns])
    tracker.replace(SLICE, [slice_("dns", ports=ports, endpoints=[])])
    host = FakeHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    proxier = Proxier(kernel=FakeKernel(), config=CONFIG, firewall=firewall)
    proxier.sync(tracker.take(), full=True)
    host.ran.clear()
    tracker.event(SLICE, "MODIFIED", slice_("dns", ports=ports, endpoints=[ep("10.244.0.9")]))
    result = proxier.sync(tracker.take(), full=False)
    assert result.forgotten == 1
    assert [args for args in host.ran if args[0] == "conntrack"] == [["conntrack", "-R", "-"]]
    tracker.event(
        SLICE,
        "MODIFIED",
        slice_("dns", ports=ports, endpoints=[ep("10.244.0.9"), ep("10.244.0.8")]),
    )
    host.ran.clear()
    assert proxier.sync(tracker.take(), full=False).forgotten == 0  # not its first one
    assert not [args for args in host.ran if args[0] == "conntrack"]
