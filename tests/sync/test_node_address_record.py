"""Virtual servers on the node's own addresses are deleted with their Service at any port,
across restarts, and a foreign one on a node address is never touched (issue 28, item 2).

IPVS over FakeKernel with its firewall over FakeHost (the record set lives there), and the
iptables fallback over FakeIptables; a restart is a fresh Proxier on the same kernel and host.
"""

from __future__ import annotations

from dataclasses import replace
from ipaddress import ip_address, ip_network
from typing import Any

from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.firewall.sets import SetState, record_of, recorded
from ipvsproxy.model import AddService, DeleteService, IpvsState, Proto, VirtualServer, VSKey
from ipvsproxy.proxier import Proxier
from ipvsproxy.sync.ownership import Ownership
from ipvsproxy.sync.render import describe
from ipvsproxy.testing import FakeKernel
from tests.factories import node, port, service
from tests.support import FakeHost, FakeIptables, Synced

CONFIG = Config(node_name="node-a")
NODE = "192.168.0.10"
EXTERNAL = VSKey(ip_address(NODE), 2222, Proto.TCP)  # externalIPs: [node address]
LOW_NODE_PORT = VSKey(ip_address(NODE), 22, Proto.TCP)  # a NodePort outside the range
FOREIGN = VSKey(ip_address(NODE), 2223, Proto.TCP)  # an administrator's `ipvsadm -A`


def services() -> list[dict[str, Any]]:
    return [
        node(addresses=(NODE,)),
        service("ext", externalIPs=[NODE], ports=[port(number=2222)]),
        service(
            "low",
            type="NodePort",
            cluster_ips=("10.96.0.11",),
            ports=[port(number=80, node_port=22)],
        ),
    ]


def ipvs_proxier(kernel: FakeKernel, host: FakeHost) -> Synced:
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    return Synced(Proxier(kernel=kernel, config=CONFIG, firewall=firewall))


def with_foreign(kernel: FakeKernel) -> None:
    state = kernel.state
    kernel.state = IpvsState(
        {**state.services, FOREIGN: VirtualServer(FOREIGN)},
        {**state.dests, FOREIGN: {}},
        state.bound,
    )


def test_a_node_address_virtual_server_goes_with_its_service_after_a_restart():
    kernel, host = FakeKernel(), FakeHost()
    assert ipvs_proxier(kernel, host).sync(services()).ok
    with_foreign(kernel)
    assert {EXTERNAL, LOW_NODE_PORT, FOREIGN} <= kernel.state.services.keys()

    restarted = ipvs_proxier(kernel, host)  # a new process: nothing known but the kernel
    planned = restarted.proxier.plan_from(restarted_changes(restarted), full=True)
    gone = {op.key for op in planned.ipvs.plan if isinstance(op, DeleteService)}
    assert {EXTERNAL, LOW_NODE_PORT} <= gone
    assert FOREIGN not in gone
    # `diff` renders what the plan holds: the deletions are shown
    lines = [
        describe(op, planned.names, planned.ipvs.observed, CONFIG.dummy_device).command
        for op in planned.ipvs.plan
    ]
    assert "ipvsadm -D -t 192.168.0.10:2222" in lines
    assert "ipvsadm -D -t 192.168.0.10:22" in lines

    assert restarted.proxier.apply(planned).ok
    assert EXTERNAL not in kernel.state.services
    assert LOW_NODE_PORT not in kernel.state.services
    assert kernel.state.services[FOREIGN] == VirtualServer(FOREIGN)  # never touched

    # and the pass after it, and another restart, leave the foreign one alone
    assert restarted.sync([node(addresses=(NODE,))]).sync.plan == ()
    again = ipvs_proxier(kernel, host)
    assert again.sync([node(addresses=(NODE,))]).sync.plan == ()
    assert FOREIGN in kernel.state.services


def restarted_changes(synced: Synced):
    synced.feed([node(addresses=(NODE,))])  # the Services were deleted while it was down
    return synced.tracker.take()


def test_a_foreign_virtual_server_on_a_node_address_is_never_claimed_after_a_restart():
    kernel, host = FakeKernel(), FakeHost()
    with_foreign(kernel)
    assert ipvs_proxier(kernel, host).sync(services()).ok
    restarted = ipvs_proxier(kernel, host)
    result = restarted.sync([node(addresses=(NODE,))])
    assert result.ok
    assert FOREIGN in kernel.state.services
    assert all(not (isinstance(op, DeleteService) and op.key == FOREIGN) for op in result.sync.plan)


def test_the_fallback_deletes_its_node_address_rules_after_a_restart():
    commands = FakeIptables()
    first = Synced(Proxier(kernel=IptablesKernel(commands=commands), config=CONFIG))
    assert first.sync(services()).ok
    saved = commands.save(4)
    assert "192.168.0.10/32" in saved
    assert "--dport 2222" in saved

    restarted = Synced(Proxier(kernel=IptablesKernel(commands=commands), config=CONFIG))
    result = restarted.sync([node(addresses=(NODE,))])
    assert result.ok
    gone = {op.key for op in result.sync.plan if isinstance(op, DeleteService)}
    assert {EXTERNAL, LOW_NODE_PORT} <= gone
    saved = commands.save(4)
    assert "--dport 2222" not in saved
    assert "--dport 22 " not in saved


class RecordedFirst(FakeKernel):
    """A kernel that, as each virtual server is created, notes whether the host's record
    already lists it: what a `kill -9` at that moment would leave."""

    def __init__(self, host: FakeHost) -> None:
        super().__init__()
        self.host = host
        self.unrecorded: list[VSKey] = []

    def apply(self, plan: Any, *, names: Any = None, access: Any = None) -> Any:
        held = self.host.held().get("IPVSPROXY-CREATED", frozenset())
        for op in plan:
            if isinstance(op, AddService) and op.vs.key.address == ip_address(NODE):
                key = op.vs.key
                if f"{key.address},tcp:{key.port}" not in held:
                    self.unrecorded.append(key)
        return super().apply(plan, names=names, access=access)


def test_a_node_address_virtual_server_is_recorded_before_it_is_created():
    """In a first pass, a partial one, and after the record set was destroyed: a kill at any
    moment leaves no node-address virtual server of ipvsproxy's out of the record."""
    kernel = RecordedFirst(host := FakeHost())
    synced = ipvs_proxier(kernel, host)
    assert synced.sync(services()).ok
    assert {EXTERNAL, LOW_NODE_PORT} <= kernel.state.services.keys()
    more = service("more", externalIPs=[NODE], ports=[port(number=2224)])
    assert synced.sync([*services(), more], full=False).ok
    assert VSKey(ip_address(NODE), 2224, Proto.TCP) in kernel.state.services
    del host.sets["IPVSPROXY-CREATED"]
    kernel.state = IpvsState()  # the node rebooted: everything is created again
    assert ipvs_proxier(kernel, host).sync(services()).ok
    assert kernel.unrecorded == []


def test_a_refused_record_write_fails_the_pass_and_the_next_one_repairs_it():
    class Refusing(FakeHost):
        refuse = True

        def run(self, args, *, stdin=None):
            if self.refuse and "add IPVSPROXY-CREATED" in (stdin or ""):
                raise KernelError("ipset: out of memory")
            return super().run(args, stdin=stdin)

    kernel, host = FakeKernel(), Refusing()
    synced = ipvs_proxier(kernel, host)
    result = synced.sync(services())
    assert "record of node-address virtual servers: ipset: out of memory" in result.firewall_error
    assert EXTERNAL in kernel.state.services  # Services still work
    host.refuse = False
    assert synced.sync(services(), full=False).full  # the firewall is observed again
    assert synced.sync(services()).ok
    assert f"{NODE},tcp:2222" in host.held()["IPVSPROXY-CREATED"]


def test_a_refused_deletion_keeps_its_record_so_a_restart_still_deletes_it():
    kernel, host = FakeKernel(), FakeHost()
    first = ipvs_proxier(kernel, host)
    assert first.sync(services()).ok
    kernel.errors[DeleteService(EXTERNAL)] = KernelError("scripted: busy")
    result = first.sync([node(addresses=(NODE,))])
    assert not result.ok
    assert EXTERNAL in kernel.state.services
    assert f"{NODE},tcp:2222" in host.held()["IPVSPROXY-CREATED"]  # still recorded
    assert f"{NODE},tcp:22" not in host.held()["IPVSPROXY-CREATED"]  # that one went

    restarted = ipvs_proxier(kernel, host)
    assert restarted.sync([node(addresses=(NODE,))]).ok
    assert EXTERNAL not in kernel.state.services
    assert f"{NODE},tcp:2222" not in host.held()["IPVSPROXY-CREATED"]


def test_the_record_lists_node_address_virtual_servers_only():
    kernel, host = FakeKernel(), FakeHost()
    assert ipvs_proxier(kernel, host).sync(services()).ok
    assert host.held()["IPVSPROXY-CREATED"] == {f"{NODE},tcp:2222", f"{NODE},tcp:22"}


def test_the_record_reads_back_what_it_records_of_either_family_and_ignores_the_rest():
    keys = [
        VSKey(ip_address("192.168.0.10"), 2222, Proto.TCP),
        VSKey(ip_address("fd00::10"), 53, Proto.UDP),
        VSKey(ip_address("192.168.0.10"), 22, Proto.SCTP),
    ]
    entries: dict[str, set[str]] = {}
    for key in keys:
        name, entry = record_of(key)
        entries.setdefault(name, set()).add(entry)
    entries["IPVSPROXY-CREATED"] |= {"garbage", "10.0.0.1,icmp:0", "fd00::1,tcp:80", "1.2.3.4"}
    state = SetState(
        {
            name: ("hash:ip,port", 6 if name.endswith("-6") else 4, frozenset(found))
            for name, found in entries.items()
        }
    )
    assert recorded(state) == frozenset(keys)
    # a set of another type under the name is no record
    assert recorded(SetState({"IPVSPROXY-CREATED": ("hash:ip", 4, frozenset())})) == frozenset()


def test_a_recorded_virtual_server_is_claimed_at_any_port_but_never_past_the_exclusions():
    key = VSKey(ip_address(NODE), 2222, Proto.TCP)
    own = Ownership(nodeport_addresses=frozenset({key.address}))
    assert not own.claims(key, frozenset())
    assert replace(own, recorded={key}).claims(key, frozenset())
    excluded = replace(own, recorded={key}, exclude_cidrs=(ip_network("192.168.0.0/24"),))
    assert not excluded.claims(key, frozenset())


IN_RANGE = VSKey(ip_address(NODE), 30080, Proto.TCP)  # a NodePort-range port on a node address


def with_virtual_servers(kernel: FakeKernel, *keys: VSKey) -> None:
    state = kernel.state
    kernel.state = IpvsState(
        {**state.services, **{k: VirtualServer(k) for k in keys}},
        {**state.dests, **{k: {} for k in keys}},
        state.bound,
    )


def test_a_foreign_virtual_server_inside_the_node_port_range_is_not_claimed_either():
    """With the record kept, the NodePort range proves nothing: an administrator's virtual
    server on node:30080 stays, across restarts."""
    kernel, host = FakeKernel(), FakeHost()
    with_virtual_servers(kernel, IN_RANGE)
    assert ipvs_proxier(kernel, host).sync(services()).ok
    restarted = ipvs_proxier(kernel, host)
    assert restarted.sync([node(addresses=(NODE,))]).ok
    assert IN_RANGE in kernel.state.services


def kube_proxy_left(host: FakeHost, *ports: int) -> None:
    """kube-proxy's IPVS mode's NodePort set, as it leaves it on the node."""
    host.sets["KUBE-NODE-PORT-TCP"] = ("bitmap:port", 4, 65536, {str(p) for p in ports})


def test_kube_proxys_node_ports_are_taken_over_or_deleted_by_its_record():
    """A node that has just moved from kube-proxy: the stale NodePort kube-proxy's set lists
    is deleted, the wanted one taken over and recorded as ipvsproxy's, and a virtual server
    in the range that the set does not list stays foreign."""
    kernel, host = FakeKernel(), FakeHost()
    wanted = VSKey(ip_address(NODE), 30090, Proto.TCP)
    foreign = VSKey(ip_address(NODE), 30091, Proto.TCP)
    with_virtual_servers(kernel, IN_RANGE, wanted, foreign)  # kube-proxy's table, and one more
    kube_proxy_left(host, 30080, 30090)
    objects = [
        node(addresses=(NODE,)),
        service("np", type="NodePort", cluster_ips=("10.96.0.12",), ports=[port(node_port=30090)]),
    ]
    result = ipvs_proxier(kernel, host).sync(objects)
    assert result.ok
    assert IN_RANGE not in kernel.state.services  # stale: kube-proxy's, deleted
    assert wanted in kernel.state.services
    assert foreign in kernel.state.services  # never kube-proxy's: untouched
    assert f"{NODE},tcp:30090" in host.held()["IPVSPROXY-CREATED"]

    # `cleanup --kube-proxy` removes kube-proxy's sets; the Service goes while ipvsproxy is down
    del host.sets["KUBE-NODE-PORT-TCP"]
    assert ipvs_proxier(kernel, host).sync([node(addresses=(NODE,))]).ok
    assert wanted not in kernel.state.services  # recorded as ipvsproxy's: deleted
    assert foreign in kernel.state.services
