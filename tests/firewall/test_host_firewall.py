"""The firewall (firewall/host_firewall.py) and its pure core: set entries, constant rules, plans,
ipset scripts, the order of its writes, and how it observes and writes the sets (by name,
in as few processes as possible, or over netlink)."""

from __future__ import annotations

from ipaddress import ip_address, ip_network
from pathlib import Path

from hypothesis import given, settings

from ipvsproxy.config import Config
from ipvsproxy.firewall.host_firewall import (
    BULK,
    JUMPS,
    Firewall,
    FirewallPlan,
    Observed,
    ipset_script,
    parse_ipset_save,
    plan_firewall,
)
from ipvsproxy.firewall.ipset import SetCommand
from ipvsproxy.firewall.rules import LocalMode, Options, render
from ipvsproxy.firewall.set_index import SetIndex
from ipvsproxy.firewall.sets import SetState, all_sets, entries_for, wanted
from ipvsproxy.iptables.parse import Saved
from ipvsproxy.model import IpvsState, Proto, RealServer, RSKey, VirtualServer, VSKey
from ipvsproxy.policy import Frontend
from ipvsproxy.sync.desired import Access
from tests.factories import desired_from_manifests, state_of
from tests.strategies import states
from tests.support import FakeHost, RecordingCommands, ScriptedCommands

EXAMPLES = Path(__file__).parent.parent.parent / "examples"


def entries(state: SetState, base: str, version: int = 4) -> frozenset[str]:
    name = f"IPVSPROXY-{base}" + ("" if version == 4 else "-6")
    return state.sets[name][2]


def test_the_bundled_example_fills_each_set_as_kubernetes_means_it():
    desired, _ = desired_from_manifests([EXAMPLES], Config(node_name="node-a"))
    sets = wanted(desired.state, desired.access, local=desired.local_endpoints)
    assert "10.96.0.10,tcp:80" in entries(sets, "CLUSTER-IP")
    assert "10.96.0.53,udp:53" in entries(sets, "CLUSTER-IP")
    assert "10.96.0.70,sctp:5060" in entries(sets, "CLUSTER-IP")
    assert "fd00:96::60,tcp:80" in entries(sets, "CLUSTER-IP", 6)
    # demo/api: an externalIP and an LB IP, policy Cluster: masqueraded
    assert {"198.51.100.7,tcp:443", "203.0.113.10,tcp:443"} <= entries(sets, "EXTERNAL-IP")
    # demo/shop: NodePort with externalTrafficPolicy Local keeps the client address
    assert not any(e.endswith(":30080") for e in entries(sets, "NODE-PORT"))
    assert "172.31.0.10,tcp:31443" in entries(sets, "NODE-PORT")
    # LOOP-BACK: node-a's own endpoints only (kube-proxy's rule), not node-b's
    assert "10.244.1.2,tcp:8000,10.244.1.2" in entries(sets, "LOOP-BACK")
    assert "10.244.1.2,udp:5353,10.244.1.2" in entries(sets, "LOOP-BACK")
    assert "fd00:244:1::2,tcp:8000,fd00:244:1::2" in entries(sets, "LOOP-BACK", 6)
    assert not any(e.startswith("10.244.2.") for e in entries(sets, "LOOP-BACK"))
    assert not any(e.startswith("172.31.5.20,") for e in entries(sets, "LOOP-BACK"))
    remote = {str(rs.address) for d in desired.state.dests.values() for rs in d} - {
        str(a) for a in desired.local_endpoints
    }
    assert remote  # the example has endpoints on other nodes: the check above means something
    assert "203.0.113.10,tcp:443" in entries(sets, "SERVICE-PORTS")
    assert not any(e.startswith("172.31.0.10,") for e in entries(sets, "SERVICE-PORTS"))
    assert entries(sets, "VIPS") == {str(a) for a in desired.state.bound if a.version == 4}


def test_load_balancer_source_ranges_become_a_firewall_with_allowed_ranges():
    key = VSKey(ip_address("203.0.113.10"), 443, Proto.TCP)
    state = state_of({VirtualServer(key): []}, bound=frozenset({key.address}))
    ranges = (ip_network("192.0.2.0/24"), ip_network("198.51.100.7/32"))
    sets = wanted(state, {key: Access(Frontend.LOAD_BALANCER, source_ranges=ranges)})
    assert entries(sets, "LB-FW") == {"203.0.113.10,tcp:443"}
    assert entries(sets, "LB-SOURCE") == {
        "203.0.113.10,tcp:443,192.0.2.0/24",
        "203.0.113.10,tcp:443,198.51.100.7",  # a full-length prefix as ipset prints it
    }
    everyone = (*ranges, ip_network("0.0.0.0/0"))  # the others inside it: merged into it
    sets = wanted(state, {key: Access(Frontend.LOAD_BALANCER, source_ranges=everyone)})
    assert entries(sets, "LB-SOURCE") == {
        "203.0.113.10,tcp:443,0.0.0.0/1",  # ipset takes no /0: its two halves
        "203.0.113.10,tcp:443,128.0.0.0/1",
    }


def test_rule_count_does_not_grow_with_services():
    options = Options(local_mode=LocalMode.CLUSTER_CIDR, local_cidrs=(ip_network("10.244.0.0/16"),))
    counts = {t: sum(len(r) for r in rs.chains.values()) for t, rs in render(4, options).items()}
    assert counts == {"nat": 11, "filter": 6}


def test_local_detection_modes():
    def prerouting(options: Options, version: int = 4) -> tuple[str, ...]:
        return render(version, options)["nat"].chains["IPVSPROXY-SERVICES"]

    cidr = Options(local_mode=LocalMode.CLUSTER_CIDR, local_cidrs=(ip_network("10.244.0.0/16"),))
    assert prerouting(cidr)[0].startswith("-A IPVSPROXY-SERVICES ! -s 10.244.0.0/16 -m set")
    assert len(prerouting(cidr, 6)) == 2  # no IPv6 pod range given: no ClusterIP masquerade
    prefix = Options(local_mode=LocalMode.INTERFACE_NAME_PREFIX, interface="veth")
    assert "! -i veth+ " in prerouting(prefix)[0]
    bridge = Options(local_mode=LocalMode.BRIDGE_INTERFACE, interface="cni0")
    assert "! -i cni0 " in prerouting(bridge)[0]
    everything = Options(masquerade_all=True)
    assert prerouting(everything)[0] == (
        "-A IPVSPROXY-SERVICES -m set --match-set IPVSPROXY-CLUSTER-IP dst,dst "
        "-j IPVSPROXY-MARK-MASQ"
    )
    assert len(prerouting(Options())) == 2  # no detection: only external and NodePort
    assert render(4, Options(masquerade_bit=15))["nat"].chains["IPVSPROXY-MARK-MASQ"] == (
        "-A IPVSPROXY-MARK-MASQ -j MARK --set-xmark 0x8000/0x8000",
    )


def observed_from(sets: SetState, options: Options) -> Observed:
    chains = {
        (v, table): Saved(rs.chains, JUMPS[table])
        for v in (4, 6)
        for table, rs in render(v, options).items()
    }
    return Observed(sets, chains)


@settings(deadline=None)
@given(states(), states())
def test_a_plan_reaches_the_wanted_sets_and_then_there_is_nothing_to_do(before, after):
    options = Options()
    old, new = wanted(before, {}), wanted(after, {})
    plan = plan_firewall(new, observed_from(old, options), options)
    assert plan.restores == ()  # the rules are constant
    result = {n: set(e) for n, (_, _, e) in old.sets.items()}
    for change in plan.sets:
        if change.swap:
            result[change.name] = set(change.wanted)
        else:
            result[change.name] |= set(change.add)
            result[change.name] -= set(change.delete)
    assert {n: frozenset(e) for n, e in result.items()} == {
        n: e for n, (_, _, e) in new.sets.items()
    }
    assert not plan_firewall(new, observed_from(new, options), options)


def test_a_cold_host_gets_every_set_created_then_rules_and_jumps():
    sets = wanted(IpvsState(), {})
    plan = plan_firewall(sets, Observed(SetState({}), {}), Options())
    assert {c.name for c in plan.sets} == {name for name, _, _ in all_sets()}
    assert all(c.create for c in plan.sets)
    assert len(plan.restores) == 4  # nat and filter, both families
    script = ipset_script(plan.sets)
    assert (
        "create IPVSPROXY-LOOP-BACK-6 hash:ip,port,ip family inet6 hashsize 1024 maxelem 65536\n"
        in script
    )
    described = plan.describe()
    jump = '-I INPUT 1 -m comment --comment "ipvsproxy ipvs filter" -j IPVSPROXY-FILTER'
    assert ("+", f"iptables -t filter {jump}") in described
    assert ("~", "ip6tables -t nat: write chain IPVSPROXY-POSTROUTING") in described


def test_many_changes_to_one_set_are_swapped_in():
    keys = [VSKey(ip_address(f"10.96.1.{n}"), 80, Proto.TCP) for n in range(BULK + 1)]
    state = state_of({VirtualServer(k): [] for k in keys}, bound=frozenset(k.address for k in keys))
    old = wanted(IpvsState(), {})
    plan = plan_firewall(wanted(state, {}), Observed(old, {}), Options())
    cluster = next(c for c in plan.sets if c.name == "IPVSPROXY-CLUSTER-IP")
    assert cluster.swap
    script = ipset_script((cluster,))
    assert script.splitlines()[:2] == [
        "destroy IPVSPROXY-CLUSTER-IP-T",  # a leftover may have other sizes
        "create IPVSPROXY-CLUSTER-IP-T hash:ip,port family inet hashsize 1024 maxelem 65536",
    ]
    assert "add IPVSPROXY-CLUSTER-IP-T 10.96.1.0,6:80\n" in script  # protocol by number
    assert script.splitlines()[-2:] == [
        "swap IPVSPROXY-CLUSTER-IP-T IPVSPROXY-CLUSTER-IP",
        "destroy IPVSPROXY-CLUSTER-IP-T",
    ]


def test_parse_ipset_save_keeps_only_ours():
    text = (
        "create KUBE-X hash:ip family inet hashsize 1024\nadd KUBE-X 1.2.3.4\n"
        "create IPVSPROXY-VIPS-6 hash:ip family inet6 hashsize 1024 maxelem 65536\n"
        "add IPVSPROXY-VIPS-6 fd00::1\n"
    )
    assert parse_ipset_save(text) == SetState(
        {"IPVSPROXY-VIPS-6": ("hash:ip", 6, frozenset({"fd00::1"}))}, {"IPVSPROXY-VIPS-6": 65536}
    )


def test_loop_back_entries_follow_this_nodes_destinations_only():
    key = VSKey(ip_address("10.96.0.10"), 80, Proto.UDP)
    here = RealServer(RSKey(ip_address("10.244.1.2"), 5353))
    there = RealServer(RSKey(ip_address("10.244.2.2"), 5353))
    state = state_of({VirtualServer(key): [here, there]}, bound=frozenset({key.address}))
    sets = wanted(state, {}, local=frozenset({here.key.address}))
    assert entries(sets, "LOOP-BACK") == {"10.244.1.2,udp:5353,10.244.1.2"}
    assert entries(wanted(state, {}), "LOOP-BACK") == frozenset()  # no local endpoint


def test_a_sync_that_removes_udp_endpoints_deletes_their_conntrack_flows():
    from ipvsproxy.firewall.conntrack import forget_udp, udp_gone
    from ipvsproxy.model import DeleteDest, DeleteService

    udp = VSKey(ip_address("10.96.0.53"), 53, Proto.UDP)
    tcp = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
    udp6 = VSKey(ip_address("fd00:96::53"), 53, Proto.UDP)
    gone = RSKey(ip_address("10.244.1.2"), 5353)
    failed = DeleteDest(udp, RSKey(ip_address("10.244.1.9"), 5353))
    ops = (DeleteDest(udp, gone), DeleteDest(tcp, gone), DeleteService(udp6), failed)
    commands = RecordingCommands()
    assert forget_udp(commands, udp_gone(ops, {failed})) == 2  # type: ignore[arg-type]
    deletes = [(args, stdin) for args, stdin in commands.fed if args[0] == "conntrack"]
    assert deletes == [  # one process for all of them
        (["conntrack", "-R", "-"],
         "-D -f ipv4 -p udp --orig-dst 10.96.0.53 --orig-port-dst 53"
         " --reply-src 10.244.1.2 --reply-port-src 5353\n"
         "-D -f ipv6 -p udp --orig-dst fd00:96::53 --orig-port-dst 53\n"),
    ]  # fmt: skip
    commands.fed.clear()
    assert forget_udp(commands, []) == 0  # type: ignore[arg-type]
    assert commands.fed == []  # nothing to delete: no process


def test_the_firewall_restores_wait_for_the_xtables_lock():
    """Every `iptables-restore` the firewall runs (apply and cleanup) waits for the lock
    as kube-proxy's does: `-w 5 -W 100000`."""
    from ipvsproxy.firewall.host_firewall import Firewall, FirewallPlan

    commands = RecordingCommands()
    firewall = Firewall(commands=commands)  # type: ignore[arg-type]
    firewall.apply(FirewallPlan(restores=((4, "nat", "*nat\nCOMMIT\n"),)))
    firewall.apply(FirewallPlan(restores=((6, "filter", "*filter\nCOMMIT\n"),)))
    restores = [args for args in commands.ran if args[0].endswith("tables-restore")]
    assert restores == [
        ["iptables-restore", "-w", "5", "-W", "100000", "--noflush"],
        ["ip6tables-restore", "-w", "5", "-W", "100000", "--noflush"],
    ]


# ---- the order of writes: sets filled before the rules that match them -------------------


class OrderHost(RecordingCommands):
    """A host recording the verbs of each set write and each rules restore, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, ...]] = []

    def run(self, args, *, stdin=None):
        if args[0].endswith("tables-restore"):
            self.writes.append(("restore",))
        return super().run(args, stdin=stdin)

    def write(self, commands: list[SetCommand]) -> int:
        self.writes.append(tuple(c.verb for c in commands))
        return 1


def _plan_on(observed: Observed) -> FirewallPlan:
    state = state_of(
        {
            VirtualServer(VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)): [
                RealServer(RSKey(ip_address("10.244.1.2"), 8080))
            ]
        },
        bound=frozenset({ip_address("10.96.0.10")}),
    )
    sets = wanted(state, {}, local=frozenset({ip_address("10.244.1.2")}))
    return plan_firewall(sets, observed, Options(), versions=(4,))


def test_sets_are_created_and_filled_before_the_rules_that_match_them():
    """On a fresh host and on one holding any of ours alike: no rule ever matches a set
    that is missing or not yet filled."""
    from ipvsproxy.firewall.host_firewall import Firewall

    fresh = _plan_on(Observed(SetState({}), {}))
    one_set = fresh.sets[0]
    seen = {one_set.name: (one_set.kind, one_set.version, frozenset[str]())}
    for observed in (
        Observed(SetState({}), {}),
        Observed(SetState(seen), {}),
        Observed(SetState({}), {(4, "nat"): Saved(chains={"IPVSPROXY-SERVICES": ()})}),
        Observed(SetState({}), {(4, "filter"): Saved(jumps=(("INPUT", "-j IPVSPROXY-X"),))}),
    ):
        plan = _plan_on(observed)
        host = OrderHost()
        firewall = Firewall(commands=host, writer=host, versions=(4,))  # type: ignore[arg-type]
        firewall.apply(plan)
        restores = [i for i, verbs in enumerate(host.writes) if verbs == ("restore",)]
        entries = [i for i, verbs in enumerate(host.writes) if "add" in verbs]
        assert entries
        assert restores
        assert max(entries) < min(restores), host.writes


# ---- observing and writing the sets (ipset processes or netlink) -------------------------


def test_sets_are_observed_by_name_in_two_processes_without_other_agents_sets():
    names = "KUBE-CLUSTER-IP\nIPVSPROXY-VIPS\nf2b-sshd\nIPVSPROXY-LOOP-BACK-T\n"
    saved = (
        "create IPVSPROXY-VIPS hash:ip family inet hashsize 1024 maxelem 131072 bucketsize 12\n"
        "add IPVSPROXY-VIPS 10.96.0.1\n"
        "create IPVSPROXY-LOOP-BACK-T hash:ip,port,ip family inet hashsize 1024 maxelem 65536\n"
    )
    commands = ScriptedCommands({("ipset", "list", "-n"): names, ("ipset", "restore"): saved})
    observed = Firewall(commands=commands).observe_sets()  # type: ignore[arg-type]
    assert commands.ran == [
        (["ipset", "list", "-n"], None),
        (["ipset", "restore"], "save IPVSPROXY-VIPS\nsave IPVSPROXY-LOOP-BACK-T\n"),
    ]
    assert observed.sets == {
        "IPVSPROXY-VIPS": ("hash:ip", 4, frozenset({"10.96.0.1"})),
        "IPVSPROXY-LOOP-BACK-T": ("hash:ip,port,ip", 4, frozenset()),
    }
    assert observed.maxelem == {"IPVSPROXY-VIPS": 131072, "IPVSPROXY-LOOP-BACK-T": 65536}


def test_a_host_without_our_sets_is_observed_with_one_process():
    commands = ScriptedCommands({("ipset", "list", "-n"): "KUBE-X\n"})
    assert Firewall(commands=commands).observe_sets() == SetState({})  # type: ignore[arg-type]
    assert len(commands.ran) == 1


def test_write_sets_is_one_ipset_restore_and_nothing_else():
    index = SetIndex(versions=(4,))
    key = VSKey(ip_address("10.96.0.1"), 80, Proto.TCP)
    index.update(key, entries_for(key, None, [], local=(), bound=True))
    commands = ScriptedCommands({("ipset", "restore", "-exist"): ""})
    written = Firewall(commands=commands).write_sets(index.take())  # type: ignore[arg-type]
    ((args, script),) = commands.ran
    assert args == ["ipset", "restore", "-exist"]
    assert script is not None
    assert "add IPVSPROXY-CLUSTER-IP 10.96.0.1,6:80\n" in script
    assert written == 9 + 3  # 9 IPv4 sets created, 3 entries (CLUSTER-IP, SERVICE-PORTS, VIPS)
    commands.ran.clear()
    assert Firewall(commands=commands).write_sets(index.take()) == 0  # type: ignore[arg-type]
    assert commands.ran == []  # nothing changed: no process


def test_a_firewall_with_a_reader_observes_without_any_process():
    class Reader:
        def observe(self):
            return SetState({"IPVSPROXY-VIPS": ("hash:ip", 4, frozenset({"10.96.0.1"}))})

    commands = ScriptedCommands({})
    firewall = Firewall(commands=commands, reader=Reader())  # type: ignore[arg-type]
    assert firewall.observe_sets().sets["IPVSPROXY-VIPS"][2] == {"10.96.0.1"}
    assert commands.ran == []


def test_a_full_pass_on_ipv4_services_empties_but_keeps_the_ipv6_sets():
    """A node that serves no IPv6 Service keeps its IPv6 sets (the rules name them)."""
    from ipvsproxy.config import Config
    from ipvsproxy.proxier import Proxier
    from ipvsproxy.testing import FakeKernel
    from tests.factories import ep, node, service, slice_
    from tests.support import Synced

    host = FakeHost()
    host.sets["IPVSPROXY-VIPS-6"] = ("hash:ip", 6, 65536, {"fd00:96::1"})
    firewall = Firewall(commands=host, versions=(4, 6))  # type: ignore[arg-type]
    proxier = Proxier(kernel=FakeKernel(), config=Config(node_name="node-a"), firewall=firewall)
    objects = [node(), service("web"), slice_("web", endpoints=[ep("10.244.0.2")])]
    assert Synced(proxier).sync(objects).ok
    assert host.held()["IPVSPROXY-VIPS-6"] == frozenset()
    assert host.held()["IPVSPROXY-VIPS"] == {"10.96.0.10"}
