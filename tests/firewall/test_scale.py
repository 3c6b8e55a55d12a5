"""The firewall at scale: set sizes, observation by name, the incremental SetIndex."""

from __future__ import annotations

from ipaddress import ip_address

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.firewall.index import SetIndex
from ipvsproxy.firewall.ipset import (
    DEFAULT_MAXELEM,
    SetChange,
    hashsize_for,
    ipset_script,
    maxelem_for,
    too_small,
)
from ipvsproxy.firewall.kernel import Firewall, Observed, plan_firewall
from ipvsproxy.firewall.rules import Options
from ipvsproxy.firewall.sets import SetState, entries_for, wanted
from ipvsproxy.model import (
    IPAddress,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    VirtualServer,
    VSKey,
    state_of,
)
from ipvsproxy.sync.desired import Access, Reach
from tests.support import FakeHost, ScriptedCommands

LOOP_BACK = "IPVSPROXY-LOOP-BACK"


# ---- sizes ---------------------------------------------------------------------------------


def test_maxelem_has_room_to_double_and_never_goes_below_ipsets_default():
    assert maxelem_for(0) == maxelem_for(1) == maxelem_for(32768) == DEFAULT_MAXELEM
    assert maxelem_for(32769) == 131072
    assert maxelem_for(100_000) == 262144
    assert hashsize_for(10) == 1024
    assert hashsize_for(10_000) == 16384
    assert not too_small(65536, 32768)
    assert too_small(65536, 32769)  # would leave less than half free
    assert too_small(65536, 70000)  # would not fit at all


def test_a_set_too_small_for_what_is_wanted_is_rebuilt_bigger_and_swapped_in():
    name = "IPVSPROXY-NODE-PORT"
    keys = [VSKey(ip_address(f"10.{n >> 16}.{n >> 8 & 255}.{n & 255}"), 80, Proto.TCP)
            for n in range(40_000)]  # fmt: skip
    state = state_of({VirtualServer(k): [] for k in keys})
    want = wanted(state, {})  # not bound: NodePorts, all in one set
    have = want.sets[name][2]
    # the host already holds every entry, in a set of ipset's default size
    observed = SetState(
        {n: (kind, v, want.sets[n][2] if n == name else frozenset())
         for n, (kind, v, _) in want.sets.items()},
        {name: DEFAULT_MAXELEM},
    )  # fmt: skip
    plan = plan_firewall(want, Observed(observed, {}), Options())
    (change,) = [c for c in plan.sets if c.name == name]
    assert change.rebuild
    assert change.swap
    assert not change.add
    assert change.wanted == have
    script = ipset_script((change,)).splitlines()
    assert script[0] == f"destroy {name}-T"
    assert script[1] == f"create {name}-T hash:ip,port family inet hashsize 65536 maxelem 131072"
    assert len(script) == 2 + 40_000 + 2
    assert script[-2:] == [f"swap {name}-T {name}", f"destroy {name}-T"]
    assert ("~", f"ipset rebuild {name} maxelem 131072") in plan.describe()
    # once big enough, nothing more to do
    bigger = SetState(observed.sets, {name: 131072})
    assert not [c for c in plan_firewall(want, Observed(bigger, {}), Options()).sets]


def test_new_sets_are_created_sized_to_their_content():
    wanted_ = frozenset(f"10.0.{n >> 8}.{n & 255},tcp:80,x" for n in range(40_000))
    change = SetChange(LOOP_BACK, "hash:ip,port,ip", 4, create=True, wanted=wanted_)
    first = ipset_script((change,)).splitlines()[0]
    assert first == f"create {LOOP_BACK} hash:ip,port,ip family inet hashsize 65536 maxelem 131072"


# ---- observation ---------------------------------------------------------------------------


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
    assert written == 8 + 3  # 8 IPv4 sets created, 3 entries (CLUSTER-IP, SERVICE-PORTS, VIPS)
    commands.ran.clear()
    assert Firewall(commands=commands).write_sets(index.take()) == 0  # type: ignore[arg-type]
    assert commands.ran == []  # nothing changed: no process


# ---- the incremental index against the full path -----------------------------------------

ADDRESSES = [ip_address(a) for a in ("10.96.0.1", "10.96.0.2", "fd00:96::1", "192.168.1.5")]
ENDPOINTS = [ip_address(a) for a in ("10.244.1.2", "10.244.1.3", "10.244.2.2", "fd00:244::2")]
ACCESS = [
    None,
    Access(Reach.CLUSTER_IP),
    Access(Reach.NODE_PORT),
    Access(Reach.NODE_PORT, local=True),
    Access(Reach.LOAD_BALANCER),
]
keys = st.builds(
    VSKey, st.sampled_from(ADDRESSES), st.sampled_from([53, 80]), st.sampled_from(list(Proto))
)
servers = st.tuples(
    st.sampled_from(ACCESS),
    st.frozensets(st.builds(RSKey, st.sampled_from(ENDPOINTS), st.sampled_from([80, 8080]))),
)
# a step: set or remove one virtual server, take (and apply), seed from the host, or reset
# the index to what is set now (a full pass; in bulk when the index is empty)
steps = st.one_of(
    st.tuples(st.just("set"), keys, servers),
    st.tuples(st.just("remove"), keys, st.none()),
    st.tuples(st.just("take"), st.none(), st.none()),
    st.tuples(st.just("seed"), st.none(), st.none()),
    st.tuples(st.just("reset"), st.none(), st.none()),
)
LOCAL: frozenset[IPAddress] = frozenset(ENDPOINTS[:2] + ENDPOINTS[3:])  # 10.244.2.2 is remote


def full(servers_now: dict[VSKey, tuple[Access | None, frozenset[RSKey]]]) -> SetState:
    return wanted(*state_and_access(servers_now), local=LOCAL)


def state_and_access(
    servers_now: dict[VSKey, tuple[Access | None, frozenset[RSKey]]],
) -> tuple[IpvsState, dict[VSKey, Access]]:
    state = IpvsState(
        services={k: VirtualServer(k) for k in servers_now},
        dests={k: {rs: RealServer(rs) for rs in d} for k, (_, d) in servers_now.items()},
        bound=frozenset(k.address for k in servers_now if k.address.is_private),
    )
    return state, {k: a for k, (a, _) in servers_now.items() if a is not None}


def apply(host: dict[str, tuple[int, set[str]]], changes: tuple[SetChange, ...]) -> None:
    """What ipset does with the script of these changes (a set over capacity fails)."""
    for change in changes:
        if change.create:
            assert change.name not in host
            host[change.name] = (maxelem_for(len(change.wanted)), set())
        if change.swap:
            host[change.name] = (maxelem_for(len(change.wanted)), set(change.wanted))
            continue
        maxelem, entries = host[change.name]
        assert not set(change.add) & entries  # exact deltas
        assert set(change.delete) <= entries
        entries |= set(change.add)
        entries -= set(change.delete)
        assert len(entries) <= maxelem


def seen(host: dict[str, tuple[int, set[str]]], kinds: SetState) -> SetState:
    return SetState(
        {n: (kinds.sets[n][0], kinds.sets[n][1], frozenset(e)) for n, (_, e) in host.items()},
        {n: m for n, (m, _) in host.items()},
    )


@settings(max_examples=300, deadline=None)  # a loaded CI host is no failure
@given(st.lists(steps, max_size=30))
def test_any_sequence_of_updates_and_takes_leaves_the_host_equal_to_the_full_path(program):
    index = SetIndex()
    host: dict[str, tuple[int, set[str]]] = {}
    now: dict[VSKey, tuple[Access | None, frozenset[RSKey]]] = {}
    for step, key, server in program:
        if step == "set":
            now[key] = server
            access, dests = server
            bound = key.address.is_private
            index.update(key, entries_for(key, access, dests, local=LOCAL, bound=bound))
        elif step == "remove":
            now.pop(key, None)
            index.update(key, frozenset())
        elif step == "take":
            apply(host, index.take())
        elif step == "reset":
            state, access = state_and_access(now)
            index.reset(state, access, local=LOCAL)
        else:
            index.seed(seen(host, full({})))
    apply(host, index.take())
    expected = full(now)
    assert {n: frozenset(e) for n, (_, e) in host.items()} == {
        n: e for n, (_, _, e) in expected.sets.items()
    }
    assert index.wanted() == expected
    index.seed(seen(host, expected))
    assert index.take() == ()  # seeded with what it wants: nothing to do
    assert index.take() == ()


def test_an_entry_wanted_by_two_virtual_servers_stays_until_both_let_go():
    index = SetIndex(versions=(4,))
    vip = ip_address("10.96.0.1")
    a, b = VSKey(vip, 80, Proto.TCP), VSKey(vip, 443, Proto.TCP)
    for key in (a, b):
        index.update(key, entries_for(key, None, [], local=(), bound=True))
    index.take()
    index.update(a, ())
    changes = {c.name: c for c in index.take()}
    assert set(changes) == {"IPVSPROXY-CLUSTER-IP", "IPVSPROXY-SERVICE-PORTS"}  # VIPS kept
    assert changes["IPVSPROXY-CLUSTER-IP"].delete == ("10.96.0.1,tcp:80",)
    index.update(b, ())
    changes = {c.name: c for c in index.take()}
    assert changes["IPVSPROXY-VIPS"].delete == ("10.96.0.1",)


def test_only_local_endpoints_enter_loop_back_through_the_index():
    state = state_of(
        {VirtualServer(VSKey(ip_address("10.96.0.9"), 80, Proto.TCP)): [
            RealServer(RSKey(ip_address("10.244.1.2"), 80)),
            RealServer(RSKey(ip_address("10.244.2.2"), 80)),
        ]},
        bound=frozenset({ip_address("10.96.0.9")}),
    )  # fmt: skip
    index = SetIndex(versions=(4,))
    index.reset(state, {}, local=frozenset({ip_address("10.244.1.2")}))
    changes = {c.name: c for c in index.take()}
    assert changes[LOOP_BACK].add == ("10.244.1.2,tcp:80,10.244.1.2",)
    index.reset(IpvsState(), {}, local=())
    assert {c.name: c.delete for c in index.take()}[LOOP_BACK] == ("10.244.1.2,tcp:80,10.244.1.2",)


def test_a_set_growing_past_half_its_capacity_is_rebuilt_by_the_index():
    index = SetIndex(versions=(4,))
    index.take()  # creates the empty sets at ipset's default size
    for n in range(32_769):
        key = VSKey(ip_address(f"10.{n >> 16}.{n >> 8 & 255}.{n & 255}"), 80, Proto.TCP)
        index.update(key, entries_for(key, Access(Reach.NODE_PORT), [], local=(), bound=False))
    (change,) = index.take()
    assert change.name == "IPVSPROXY-NODE-PORT"
    assert change.rebuild
    assert change.swap
    assert len(change.wanted) == 32_769
    assert "maxelem 131072" in ipset_script((change,)).splitlines()[1]


# ---- the proxier's two entry points against a fake ipset ---------------------------------


def synced(count: int, *, local: frozenset[IPAddress]):
    """(the synced IPVS state, the desired state) of `count` ClusterIP virtual servers."""
    from ipvsproxy.sync.desired import Desired

    vss = {
        VirtualServer(VSKey(ip_address(f"10.96.{n >> 8}.{n & 255}"), 80, Proto.TCP)): [
            RealServer(RSKey(ip_address(f"10.244.{n % 3}.{n & 255}"), 8080))
        ]
        for n in range(count)
    }
    state = state_of(vss, bound=frozenset(v.key.address for v in vss))
    return state, Desired(state, local_endpoints=local)


def test_a_cheap_header_check_finds_drift_between_full_passes():
    from ipvsproxy.firewall.ipset import parse_headers

    host = FakeHost()
    firewall = Firewall(commands=host, versions=(4,))  # type: ignore[arg-type]
    index = SetIndex(versions=(4,))
    state, desired = synced(10, local=frozenset())
    index.reset(state, desired.access, local=())
    firewall.write_sets(index.take())

    def headers():
        text = "".join(
            f"Name: {name}\nType: {kind}\nRevision: 7\nHeader: family "
            f"{'inet' if v == 4 else 'inet6'} hashsize 1024 maxelem {m} bucketsize 12\n"
            f"Size in memory: 264\nReferences: 0\nNumber of entries: {len(e)}\n\n"
            for name, (kind, v, m, e) in host.sets.items()
        )
        return parse_headers(text + "Name: KUBE-X\nType: hash:ip\nNumber of entries: 3\n")

    assert index.drifted(headers()) == ()
    host.sets["IPVSPROXY-VIPS"][3].discard("10.96.0.3")  # someone deleted an entry
    assert index.drifted(headers()) == ("IPVSPROXY-VIPS",)
    host.sets["IPVSPROXY-VIPS"][3].add("10.96.0.3")
    host.sets["IPVSPROXY-LB-FW-T"] = ("hash:ip,port", 4, 65536, set())  # a leftover
    del host.sets["IPVSPROXY-NODE-PORT"]
    assert index.drifted(headers()) == ("IPVSPROXY-LB-FW-T", "IPVSPROXY-NODE-PORT")


def test_headers_parsed_from_ipset_list_t_as_ipset_7_17_prints_them():
    from ipvsproxy.firewall.ipset import parse_headers

    text = (
        "Name: IPVSPROXY-A\nType: hash:ip,port\nRevision: 7\n"
        "Header: family inet hashsize 1024 maxelem 131072 bucketsize 12 initval 0x49249889\n"
        "Size in memory: 264\nReferences: 0\nNumber of entries: 1\n\n"
        "Name: KUBE-B\nType: hash:ip\nRevision: 6\n"
        "Header: family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x7fd5e1b8\n"
        "Size in memory: 216\nReferences: 0\nNumber of entries: 0\n\n"
        "Name: IPVSPROXY-B-6\nType: hash:ip\nRevision: 6\n"
        "Header: family inet6 hashsize 1024 maxelem 65536 bucketsize 12 initval 0x7fd5e1b8\n"
        "Size in memory: 216\nReferences: 1\nNumber of entries: 12\n"
    )
    assert parse_headers(text) == {
        "IPVSPROXY-A": ("hash:ip,port", 4, 131072, 1),
        "IPVSPROXY-B-6": ("hash:ip", 6, 65536, 12),
    }


# ---- sets read over netlink ----------------------------------------------------------------


def nla(kind: int, payload: bytes, flags: int = 0) -> bytes:
    size = 4 + len(payload)
    return (size.to_bytes(2, "little") + (kind | flags).to_bytes(2, "little") + payload
            + b"\0" * (-size % 4))  # fmt: skip


NESTED, NET = 0x8000, 0x4000


def test_entries_decoded_as_ipset_save_prints_them():
    """Attributes as the 6.18 kernel dumped them (captured from a throw-away netns)."""
    from ipvsproxy.firewall.nlread import decode_entry

    def ip(hexa: str, family: int = 1) -> bytes:
        return nla(family, bytes.fromhex(hexa))

    loop = (nla(1, ip("0af40103"), NESTED) + nla(20, ip("0af40103"), NESTED)
            + nla(4, bytes.fromhex("0035"), NET) + nla(7, b"\x11"))  # fmt: skip
    assert decode_entry(loop) == "10.244.1.3,udp:53,10.244.1.3"
    net = (nla(1, ip("cb00710a"), NESTED) + nla(20, ip("c0000200"), NESTED)
           + nla(4, bytes.fromhex("01bb"), NET) + nla(21, b"\x18") + nla(7, b"\x06"))  # fmt: skip
    assert decode_entry(net) == "203.0.113.10,tcp:443,192.0.2.0/24"
    host = (nla(1, ip("cb00710a"), NESTED) + nla(20, ip("c6336407"), NESTED)
            + nla(4, bytes.fromhex("01bb"), NET) + nla(21, b"\x20") + nla(7, b"\x84"))  # fmt: skip
    assert decode_entry(host) == "203.0.113.10,sctp:443,198.51.100.7"  # /32 printed bare
    v6 = nla(1, ip("fd000096000000000000000000000001", 2), NESTED)
    assert decode_entry(v6) == "fd00:96::1"
    cluster = nla(1, ip("0a600001"), NESTED) + nla(4, bytes.fromhex("0050"), NET) + nla(7, b"\x06")
    assert decode_entry(cluster) == "10.96.0.1,tcp:80"


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


def test_local_addresses_are_told_apart_by_family():
    """::a00:1 has the integer of 10.0.0.1 but is not it: no hairpin entry for it."""
    local = frozenset({ip_address("10.0.0.1")})
    for endpoint, vip, entry in (
        ("10.0.0.1", "10.96.0.1", "10.0.0.1,tcp:80,10.0.0.1"),
        ("::a00:1", "fd00:96::1", None),  # not local: no hairpin entry
    ):
        key = VSKey(ip_address(vip), 80, Proto.TCP)
        dests = [RSKey(ip_address(endpoint), 80)]
        made = entries_for(key, None, dests, local=local, bound=True)
        assert {e for name, e in made if name.startswith(LOOP_BACK)} == ({entry} - {None})
