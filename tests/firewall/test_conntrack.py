"""UDP flows cached as a black hole before a virtual server's first endpoint are deleted
when it gets one (kube-proxy's CleanStaleEntries), in the same single `conntrack -R -` run
as the flows of removed endpoints; also end to end, by the proxier in a partial pass."""

from __future__ import annotations

from ipaddress import ip_address

from ipvsproxy.config import Config
from ipvsproxy.firewall.conntrack import deletions, forget_udp, udp_first_endpoint, udp_gone
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.model import (
    AddDest,
    AddService,
    DeleteDest,
    IpvsState,
    Op,
    Proto,
    RealServer,
    RSKey,
    UpdateDest,
    VirtualServer,
    VSKey,
)
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, port, service, slice_
from tests.support import FakeHost, RecordingCommands

DNS = VSKey(ip_address("10.96.0.10"), 53, Proto.UDP)  # a ClusterIP
NODEPORT = VSKey(ip_address("192.168.0.10"), 30053, Proto.UDP)  # node address:NodePort
DNS6 = VSKey(ip_address("fd00:96::a"), 53, Proto.UDP)
WEB = VSKey(ip_address("10.96.0.80"), 80, Proto.TCP)
POD = RSKey(ip_address("10.244.1.2"), 5353)
OTHER = RSKey(ip_address("10.244.2.3"), 5353)


def before(table: dict[VSKey, list[RealServer]]) -> IpvsState:
    """The table before the pass: each virtual server with these destinations."""
    return IpvsState(
        services={key: VirtualServer(key) for key in table},
        dests={key: {rs.key: rs for rs in servers} for key, servers in table.items()},
    )


def add(key: VSKey, rs: RSKey = POD, weight: int = 1) -> AddDest:
    return AddDest(key, RealServer(rs, weight=weight))


def test_first_endpoint_of_a_udp_clusterip_deletes_every_flow_to_it():
    ops: list[Op] = [add(DNS)]
    assert udp_first_endpoint(ops, before({DNS: []}), set()) == [DNS]
    assert deletions(udp_gone(ops, set(), before=before({DNS: []}))) == [
        "-D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53"
    ]


def test_first_endpoint_of_a_udp_nodeport_deletes_the_flows_to_the_node_address_and_port():
    ops: list[Op] = [add(NODEPORT)]
    assert deletions(udp_gone(ops, set(), before=before({NODEPORT: []}))) == [
        "-D -f ipv4 -p udp --orig-dst 192.168.0.10 --orig-port-dst 30053"
    ]


def test_a_new_udp_virtual_server_with_endpoints_counts_as_a_first_endpoint():
    """Flows to its address and port may be cached from before it existed."""
    ops: list[Op] = [AddService(VirtualServer(DNS6)), add(DNS6), add(DNS6, OTHER)]
    assert udp_first_endpoint(ops, IpvsState(), set()) == [DNS6]  # once, not per destination
    assert deletions(udp_gone(ops, set(), before=IpvsState())) == [
        "-D -f ipv6 -p udp --orig-dst fd00:96::a --orig-port-dst 53"
    ]


def test_none_for_tcp():
    assert udp_first_endpoint([add(WEB)], before({WEB: []}), set()) == []


def test_none_when_the_server_already_had_an_endpoint():
    table = before({DNS: [RealServer(OTHER)]})
    assert udp_first_endpoint([add(DNS)], table, set()) == []
    assert udp_gone([add(DNS)], set(), before=table) == []


def test_draining_destinations_do_not_count_and_weight_zero_does_not_revive():
    """A server with only weight-0 (draining) destinations schedules nothing: its flows
    are black holes too. A weight-0 destination added is no endpoint either."""
    draining = before({DNS: [RealServer(OTHER, weight=0)]})
    assert udp_first_endpoint([add(DNS)], draining, set()) == [DNS]
    assert udp_first_endpoint([add(DNS, weight=0)], draining, set()) == []
    back = UpdateDest(DNS, RealServer(OTHER, weight=1))  # a draining endpoint came back
    assert udp_first_endpoint([back], draining, set()) == [DNS]


def test_a_refused_add_deletes_nothing():
    op = add(DNS)
    assert udp_first_endpoint([op], before({DNS: []}), {op}) == []


def test_without_the_table_before_only_removed_endpoints_count():
    assert udp_gone([add(DNS)], set()) == []


def test_first_endpoints_and_removed_ones_go_in_one_batch():
    table = before({DNS: [], NODEPORT: [], DNS6: [RealServer(POD), RealServer(OTHER)]})
    ops: list[Op] = [add(DNS), add(NODEPORT), DeleteDest(DNS6, OTHER), add(WEB)]
    commands = RecordingCommands()
    asked = forget_udp(commands, udp_gone(ops, set(), before=table))  # type: ignore[arg-type]
    assert asked == 3
    assert commands.fed == [  # one process for all of them
        (["conntrack", "-R", "-"],
         "-D -f ipv6 -p udp --orig-dst fd00:96::a --orig-port-dst 53"
         " --reply-src 10.244.2.3 --reply-port-src 5353\n"
         "-D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53\n"
         "-D -f ipv4 -p udp --orig-dst 192.168.0.10 --orig-port-dst 30053\n"),
    ]  # fmt: skip


# ---- through the proxier: a first endpoint in a partial pass -----------------------------
# The proxier forgets UDP flows that cached a black hole: when a UDP
# virtual server gets its first endpoint in a partial pass, its flows are deleted in the same
# single `conntrack -R -` batch as those of removed endpoints.


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
