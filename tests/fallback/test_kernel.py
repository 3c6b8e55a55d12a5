"""IptablesKernel over a scripted Commands: partial syncs read nothing and write only the
chains that change; a full observation still finds and repairs damage."""

from __future__ import annotations

import re
from dataclasses import replace
from ipaddress import ip_address, ip_network

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.fallback.chains import SERVICES, render, sep_chain, svc_chain
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteService,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    UpdateDest,
    VirtualServer,
    VSKey,
)
from ipvsproxy.sync.ownership import Ownership
from ipvsproxy.sync.plan import plan
from tests.factories import state_of
from tests.strategies import states
from tests.support import FakeIptables

EVERYTHING = Ownership(service_cidrs=(ip_network("0.0.0.0/0"), ip_network("::/0")))
KEYS = [VSKey(ip_address(f"10.96.0.{n}"), 80, Proto.TCP) for n in range(1, 4)]
RS = [RealServer(RSKey(ip_address(f"10.244.1.{n}"), 8080)) for n in range(1, 4)]
STATE = state_of({VirtualServer(key): RS for key in KEYS}, bound=frozenset(k.address for k in KEYS))


def loaded() -> tuple[IptablesKernel, FakeIptables]:
    commands = FakeIptables()
    kernel = IptablesKernel(commands=commands)
    assert kernel.apply(plan(STATE, kernel.observe(), ownership=EVERYTHING)).ok
    commands.calls.clear()
    return kernel, commands


def test_a_partial_sync_reads_nothing_and_writes_only_the_changed_chains():
    kernel, commands = loaded()
    drained = replace(RS[1], weight=0)
    assert kernel.apply([UpdateDest(KEYS[0], drained)]).ok
    assert commands.tools() == ["iptables-restore"]
    assert commands.declared() == {svc_chain(KEYS[0]), sep_chain(KEYS[0], RS[1].key)}


def test_nothing_to_do_runs_nothing():
    kernel, commands = loaded()
    assert kernel.apply([]).ok
    assert kernel.apply([], names={KEYS[0]: str(KEYS[0])}).ok  # the name it already has
    assert commands.calls == []


def test_a_new_service_writes_its_chains_and_the_dispatch_chain_only():
    kernel, commands = loaded()
    key = VSKey(ip_address("fd00:96::9"), 53, Proto.UDP)
    rs = RealServer(RSKey(ip_address("fd00:244::9"), 5353))
    assert kernel.apply([AddService(VirtualServer(key)), AddDest(key, rs)]).ok
    assert commands.tools() == ["ip6tables-restore"]
    assert commands.declared() == {SERVICES, svc_chain(key), sep_chain(key, rs.key)}


def test_a_deleted_service_takes_its_chains_with_it():
    kernel, commands = loaded()
    assert kernel.apply([DeleteService(KEYS[2])]).ok
    (payload,) = [p for tool, p in commands.calls]
    deleted = {line.split()[1] for line in payload.splitlines() if line.startswith("-X")}
    assert deleted == {svc_chain(KEYS[2])} | {sep_chain(KEYS[2], rs.key) for rs in RS}
    assert not any(chain in commands.save(4) for chain in deleted)


def test_binding_a_vip_rewrites_the_masquerade_of_its_services_only():
    commands = FakeIptables()
    kernel = IptablesKernel(commands=commands)
    unbound = replace(STATE, bound=frozenset())
    assert kernel.apply(plan(unbound, kernel.observe(), ownership=EVERYTHING)).ok
    commands.calls.clear()
    assert kernel.apply([BindAddress(KEYS[1].address)]).ok
    assert commands.declared() == {SERVICES} | {sep_chain(KEYS[1], rs.key) for rs in RS}


def test_a_refused_restore_fails_its_ops_and_the_next_apply_reads_again():
    kernel, commands = loaded()
    commands.fail.add("iptables-restore")
    report = kernel.apply([UpdateDest(KEYS[0], replace(RS[0], weight=3))])
    assert [f.op for f in report.failures] == [UpdateDest(KEYS[0], replace(RS[0], weight=3))]
    commands.calls.clear()
    assert kernel.apply([UpdateDest(KEYS[0], replace(RS[0], weight=3))]).ok
    assert commands.tools()[:2] == ["iptables-save", "ip6tables-save"]
    assert IptablesKernel(commands=commands).observe().dests[KEYS[0]][RS[0].key].weight == 3


def test_damage_is_found_by_a_full_observation_and_repaired_by_the_next_apply():
    kernel, commands = loaded()
    good = commands.save(4)
    commands.tables[4][svc_chain(KEYS[1])].pop()  # a rule deleted behind our back
    commands.tables[4]["IPVSPX-SEP-STRAYSTRAYSTRAYS"] = []  # a chain an old version left
    kernel.apply([])  # a partial sync does not look
    assert commands.save(4) != good
    kernel.observe()
    assert len(kernel.damage()) == 2
    assert kernel.apply([]).ok
    assert commands.save(4) == good
    assert kernel.damage() == ()


@st.composite
def histories(draw):
    """A few desired states in a row, each with some of its VIPs unbound (NodePorts)."""
    out = []
    for state in draw(st.lists(states(), min_size=1, max_size=4)):
        keep = (
            draw(st.sets(st.sampled_from(sorted(state.bound, key=str)))) if state.bound else set()
        )
        out.append(replace(state, bound=frozenset(keep)))
    return out


@settings(max_examples=60, deadline=None)
@given(histories())
def test_partial_syncs_add_up_to_what_a_full_render_gives(history):
    commands = FakeIptables()
    kernel = IptablesKernel(commands=commands)
    current = kernel.observe()
    for desired in history:
        commands.calls.clear()
        names = {key: f"ns/svc-{key.port}:p" for key in desired.services}
        assert kernel.apply(plan(desired, current, ownership=EVERYTHING), names=names).ok
        assert not set(commands.tools()) & {"iptables-save", "ip6tables-save"}
        for version in (4, 6):
            want = render(desired, names, version=version).chains
            have = {
                c: tuple(f"-A {c} {r}" for r in rules)
                for c, rules in commands.tables[version].items()
                if c.startswith("IPVSPX-")
            }
            assert have == want
        assert kernel.observe() == desired  # undamaged: the chains are the last state
        assert commands.tools()[-2:] == ["iptables-save", "ip6tables-save"]
        fresh = IptablesKernel(commands=commands)
        assert fresh.observe() == desired
        assert fresh.damage() == ()
        current = desired


def test_ops_fail_like_the_kernel_and_change_nothing():
    kernel, commands = loaded()
    report = kernel.apply([AddService(VirtualServer(KEYS[0])), UpdateDest(KEYS[0], RS[0])])
    assert [type(f.error).__name__ for f in report.failures] == ["AlreadyExists"]
    assert commands.calls == []  # UpdateDest to the same settings: nothing differs
    assert kernel.observe() == STATE
    assert IpvsState() != STATE


def test_chains_of_the_previous_layout_are_replaced_by_one_sync():
    """Before the grouped names, a destination's chain was IPVSPX-SEP-<h8><e8>."""
    _, commands = loaded()

    def old(text: str) -> str:
        return re.sub(r"IPVSPX-SVC-(\w{8})-(\w{8})", r"IPVSPX-SEP-\1\2", text)

    tables = commands.tables
    tables[4] = {old(c): [old(r) for r in rules] for c, rules in tables[4].items()}
    assert any(c.startswith("IPVSPX-SEP-") for c in commands.tables[4])
    kernel = IptablesKernel(commands=commands)
    observed = kernel.observe()
    assert kernel.damage()
    assert kernel.apply(plan(STATE, observed, ownership=EVERYTHING)).ok
    have = {c: tuple(f"-A {c} {r}" for r in rules)
            for c, rules in commands.tables[4].items() if c.startswith("IPVSPX-")}  # fmt: skip
    assert have == render(STATE, {}, version=4).chains


def test_restores_wait_for_the_xtables_lock_as_kube_proxy_does():
    """`-w 5 -W 100000` on every restore (apply, repair, cleanup); the save tools take no
    -w (iptables 1.8.9 refuses it, legacy and nf_tables alike)."""
    kernel, commands = loaded()
    assert kernel.apply([UpdateDest(KEYS[0], replace(RS[1], weight=0))]).ok
    kernel.cleanup()
    restores = [argv for argv in commands.argv if argv[0].endswith("-restore")]
    saves = [argv for argv in commands.argv if argv[0].endswith("-save")]
    assert restores
    assert saves
    for argv in restores:
        assert argv[1:] == ("-w", "5", "-W", "100000", "--noflush"), argv
    for argv in saves:
        assert "-w" not in argv, argv
