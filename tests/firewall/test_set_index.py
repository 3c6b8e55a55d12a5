"""The incremental SetIndex: any sequence of updates and takes leaves the host's sets equal
to the full path's (hypothesis, against a fake ipset), and drift between full passes found
by a cheap check of the sets' headers."""

from __future__ import annotations

from ipaddress import ip_address

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.firewall.host_firewall import Firewall
from ipvsproxy.firewall.ipset import (
    SetChange,
    ipset_script,
    maxelem_for,
)
from ipvsproxy.firewall.set_index import SetIndex
from ipvsproxy.firewall.sets import SetState, entries_for, wanted
from ipvsproxy.model import (
    IPAddress,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    VirtualServer,
    VSKey,
)
from ipvsproxy.policy import Frontend
from ipvsproxy.sync.desired import Access
from tests.factories import state_of
from tests.support import FakeHost

LOOP_BACK = "IPVSPROXY-LOOP-BACK"


ADDRESSES = [ip_address(a) for a in ("10.96.0.1", "10.96.0.2", "fd00:96::1", "192.168.1.5")]


ENDPOINTS = [ip_address(a) for a in ("10.244.1.2", "10.244.1.3", "10.244.2.2", "fd00:244::2")]


ACCESS = [
    None,
    Access(Frontend.CLUSTER_IP),
    Access(Frontend.NODE_PORT),
    Access(Frontend.NODE_PORT, local=True),
    Access(Frontend.LOAD_BALANCER),
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
        index.update(key, entries_for(key, Access(Frontend.NODE_PORT), [], local=(), bound=False))
    changes = {change.name: change for change in index.take()}
    # a NodePort is on a node address: recorded as ipvsproxy's too (the same size)
    assert changes.keys() == {"IPVSPROXY-NODE-PORT", "IPVSPROXY-CREATED"}
    assert changes["IPVSPROXY-CREATED"].rebuild
    change = changes["IPVSPROXY-NODE-PORT"]
    assert change.rebuild
    assert change.swap
    assert len(change.wanted) == 32_769
    assert "maxelem 131072" in ipset_script((change,)).splitlines()[1]


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
