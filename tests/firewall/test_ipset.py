"""ipset (firewall/ipset.py): set sizes (maxelem with room to double, hashsize), a set too
small rebuilt bigger and swapped in, restore scripts, and headers as `ipset list -t` prints
them."""

from __future__ import annotations

from ipaddress import ip_address

from ipvsproxy.firewall.host_firewall import Observed, plan_firewall
from ipvsproxy.firewall.ipset import (
    DEFAULT_MAXELEM,
    SetChange,
    hashsize_for,
    ipset_script,
    maxelem_for,
    too_small,
)
from ipvsproxy.firewall.rules import Options
from ipvsproxy.firewall.sets import SetState, wanted
from ipvsproxy.model import (
    Proto,
    VirtualServer,
    VSKey,
)
from tests.factories import state_of

LOOP_BACK = "IPVSPROXY-LOOP-BACK"


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
    # once big enough, nothing more to do (to this set: IPVSPROXY-CREATED, empty here, has
    # the same entries to take)
    bigger = SetState(observed.sets, {name: 131072})
    assert not [c for c in plan_firewall(want, Observed(bigger, {}), Options()).sets
                if c.name == name]  # fmt: skip


def test_new_sets_are_created_sized_to_their_content():
    wanted_ = frozenset(f"10.0.{n >> 8}.{n & 255},tcp:80,x" for n in range(40_000))
    change = SetChange(LOOP_BACK, "hash:ip,port,ip", 4, create=True, wanted=wanted_)
    first = ipset_script((change,)).splitlines()[0]
    assert first == f"create {LOOP_BACK} hash:ip,port,ip family inet hashsize 65536 maxelem 131072"


def test_headers_parsed_from_ipset_list_t_as_ipset_7_17_prints_them():
    from ipvsproxy.firewall.ipset import parse_headers

    text = (
        "Name: IPVSPROXY-CLUSTER-IP\nType: hash:ip,port\nRevision: 7\n"
        "Header: family inet hashsize 1024 maxelem 131072 bucketsize 12 initval 0x49249889\n"
        "Size in memory: 264\nReferences: 0\nNumber of entries: 1\n\n"
        "Name: IPVSPROXY-MINE\nType: hash:ip\nRevision: 6\n"  # not ours: a similar name
        "Header: family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x7fd5e1b8\n"
        "Size in memory: 216\nReferences: 0\nNumber of entries: 0\n\n"
        "Name: KUBE-B\nType: hash:ip\nRevision: 6\n"
        "Header: family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x7fd5e1b8\n"
        "Size in memory: 216\nReferences: 0\nNumber of entries: 0\n\n"
        "Name: IPVSPROXY-VIPS-6\nType: hash:ip\nRevision: 6\n"
        "Header: family inet6 hashsize 1024 maxelem 65536 bucketsize 12 initval 0x7fd5e1b8\n"
        "Size in memory: 216\nReferences: 1\nNumber of entries: 12\n"
    )
    assert parse_headers(text) == {
        "IPVSPROXY-CLUSTER-IP": ("hash:ip,port", 4, 131072, 1),
        "IPVSPROXY-VIPS-6": ("hash:ip", 6, 65536, 12),
    }
