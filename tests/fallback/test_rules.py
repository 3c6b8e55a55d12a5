"""The iptables backend's pure core: rendering, reading back, damage, transactions, and
IPVSPX-FORWARD (kube-proxy's KUBE-FORWARD in iptables mode), rendered from the same policy
as the IPVS firewall's IPVSPROXY-FORWARD."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import ip_address

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.fallback.chain_reader import read_state
from ipvsproxy.fallback.chains import (
    FILTER_JUMPS,
    FORWARD,
    JUMPS,
    SERVICES,
    filter_ruleset,
    owned,
    owned_filter,
    render,
    sanitise,
    sep_chain,
    svc_chain,
)
from ipvsproxy.firewall.rules import FORWARD as COMPANION_FORWARD
from ipvsproxy.firewall.rules import render as firewall_render
from ipvsproxy.iptables.parse import Saved, parse_save
from ipvsproxy.iptables.transaction import Ruleset, damage, removal, transaction
from ipvsproxy.model import (
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    ServiceFlags,
    VirtualServer,
    VSKey,
)
from ipvsproxy.policy import NodePolicy
from ipvsproxy.schedulers import Scheduler
from tests.factories import state_of
from tests.strategies import states

KEY = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
RS = [RealServer(RSKey(ip_address(f"10.244.1.{n}"), 8080)) for n in (1, 2, 3)]


def saved_from(ruleset: Ruleset) -> Saved:
    return Saved(ruleset.chains, JUMPS)


def merged(state: IpvsState, names: dict[VSKey, str]) -> tuple[IpvsState, dict[VSKey, str]]:
    """Render both families and read them back as the kernel does."""
    found = [read_state(saved_from(render(state, names, version=v))) for v in (4, 6)]
    return (
        IpvsState(
            services={k: v for s, _ in found for k, v in s.services.items()},
            dests={k: v for s, _ in found for k, v in s.dests.items()},
            bound=frozenset(a for s, _ in found for a in s.bound),
        ),
        {k: n for _, ns in found for k, n in ns.items()},
    )


def test_round_robin_is_nth_over_the_destinations_of_weight_above_zero():
    drained = replace(RS[2], weight=0)
    state = state_of({VirtualServer(KEY): [RS[0], RS[1], drained]}, bound=frozenset({KEY.address}))
    chains = render(state, {KEY: "default/web:http"}, version=4).chains
    svc = svc_chain(KEY)
    seps = [sep_chain(KEY, rs.key) for rs in RS]
    assert chains[SERVICES] == (
        f'-A {SERVICES} -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http '
        f'sched=rr flags=0x0 timeout=0" -m tcp --dport 80 -j {svc}',
        f'-A {SERVICES} -d 10.96.0.10/32 -m comment --comment "ipvsproxy vip" -j RETURN',
    )
    assert chains[svc] == (
        f"-A {svc} -m statistic --mode nth --every 2 --packet 0 -j {seps[0]}",
        f"-A {svc} -j {seps[1]}",
    )
    assert chains[seps[2]][-1] == (
        f'-A {seps[2]} -p tcp -m comment --comment "default/web:http weight=0" '
        "-j DNAT --to-destination 10.244.1.3:8080"
    )


def test_source_hashing_affinity_and_nodeport_masquerade():
    vs = VirtualServer(KEY, Scheduler.SH, ServiceFlags.PERSISTENT | ServiceFlags.SCHED2, 600)
    chains = render(state_of({vs: RS[:2]}), {}, version=4).chains  # not bound: a NodePort
    svc, sep = svc_chain(KEY), sep_chain(KEY, RS[0].key)
    assert chains[svc][0] == (
        f"-A {svc} -m recent --rcheck --seconds 600 --reap --name {sep} "
        f"--mask 255.255.255.255 --rsource -j {sep}"
    )
    assert chains[svc][2] == (
        f"-A {svc} -j HMARK --hmark-src-prefix 32 --hmark-sport-mask 0xffff "
        "--hmark-rnd 0x69707673 --hmark-mod 2 --hmark-offset 1"
    )
    assert chains[svc][3] == f"-A {svc} -m mark --mark 0x1 -j {sep}"
    assert f"-A {sep} -j IPVSPX-MARK-MASQ" in chains[sep]
    assert f"-A {sep} -s 10.244.1.1/32 -j IPVSPX-MARK-MASQ" in chains[sep]


def test_random_spread_follows_weights_as_iptables_prints_probabilities():
    weighted = [replace(RS[0], weight=1), replace(RS[1], weight=2)]
    chains = render(state_of({VirtualServer(KEY, Scheduler.WRR): weighted}), {}, version=4).chains
    svc = svc_chain(KEY)
    assert "--probability 0.33333333349" in chains[svc][0]


@settings(deadline=None)  # a shared, loaded host: timings vary 1000x
@given(states())
def test_what_is_rendered_reads_back_exactly_and_undamaged(state):
    names = {key: f"ns/svc-{n}:port" for n, key in enumerate(state.services)}
    observed, seen = merged(state, names)
    assert observed == state
    assert seen == names
    for version in (4, 6):
        ruleset = render(state, names, version=version)
        assert damage(saved_from(ruleset), ruleset, jumps=JUMPS) == ()
        assert transaction(saved_from(ruleset), ruleset, jumps=JUMPS) == ""


@settings(deadline=None)
@given(states(), states())
def test_a_transaction_touches_only_chains_that_differ(before, after):
    old, new = render(before, {}, version=4), render(after, {}, version=4)
    payload = transaction(saved_from(old), new, jumps=JUMPS)
    declared = {line[1:].split()[0] for line in payload.splitlines() if line.startswith(":")}
    differ = {
        c for c in set(old.chains) | set(new.chains) if old.chains.get(c) != new.chains.get(c)
    }
    assert declared == differ
    deleted = {line.split()[1] for line in payload.splitlines() if line.startswith("-X")}
    assert deleted == set(old.chains) - set(new.chains)
    assert not any(line.startswith(("-I", "-D")) for line in payload.splitlines())


def test_missing_and_doubled_jumps_are_damage_and_fixed_one_by_one():
    ruleset = render(IpvsState(), {}, version=4)
    prerouting, output, postrouting = JUMPS
    saved = Saved(ruleset.chains, (prerouting, prerouting, postrouting))
    assert damage(saved, ruleset, jumps=JUMPS) == (
        "2 jumps from PREROUTING where 1 belongs",
        "0 jumps from OUTPUT where 1 belongs",
    )
    assert transaction(saved, ruleset, jumps=JUMPS).splitlines()[1:-1] == [
        f"-D PREROUTING {prerouting[1]}",
        f"-I OUTPUT 1 {output[1]}",
    ]


SAVE = """# Generated by iptables-save
*filter
:INPUT ACCEPT [0:0]
-A INPUT -j IPVSPX-SERVICES
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:IPVSPX-SERVICES - [0:0]
:IPVSPX-SVC-EMPTYEMPTYEMPTYE - [0:0]
:IPVSPX-X - [0:0]
:OTHER - [0:0]
-A PREROUTING -m comment --comment "ipvsproxy service portals" -j IPVSPX-SERVICES
-A PREROUTING -d 192.0.2.1/32 -j DNAT --to-destination 192.0.2.2
-A PREROUTING -s 192.0.2.0/24 -j IPVSPX-X
-A OTHER -j RETURN
-A IPVSPX-X -j RETURN
{dispatch}
COMMIT
""".format(
    dispatch='-A IPVSPX-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment "x sched=zz '
    'flags=0x0 timeout=0" -m tcp --dport 80 -j IPVSPX-SVC-AAAAAAAAAAAAAAAA'
)


def test_parse_keeps_only_our_nat_chains_and_jumps_and_skips_what_it_cannot_read():
    saved = parse_save(SAVE, owns=owned)
    empty = "IPVSPX-SVC-EMPTYEMPTYEMPTYE"
    assert set(saved.chains) == {"IPVSPX-SERVICES", empty}  # IPVSPX-X: not a name of ours
    assert saved.chains[empty] == ()
    assert saved.jumps == (JUMPS[0],)
    state, _ = read_state(saved)
    assert state == IpvsState()  # an unknown scheduler: left out, so it gets rewritten
    assert removal(saved).splitlines() == [
        "*nat",
        f"-D PREROUTING {JUMPS[0][1]}",
        ":IPVSPX-SERVICES - [0:0]",
        f":{empty} - [0:0]",
        "-X IPVSPX-SERVICES",
        f"-X {empty}",
        "COMMIT",
    ]


@given(st.text())
def test_sanitised_names_cannot_leave_a_comment(name):
    safe = sanitise(name)
    assert safe
    assert len(safe) <= 160
    assert not set(safe) & set("\"\\\n\r\t $`;'")


def test_a_large_load_creates_its_chains_first_out_of_name_order_in_small_transactions():
    state = state_of(
        {
            VirtualServer(VSKey(ip_address(f"10.96.{n // 250}.{n % 250}"), 80, Proto.TCP)): RS
            for n in range(100)
        }
    )
    target = render(state, {}, version=4)
    sections = transaction(Saved(), target, jumps=JUMPS).split("COMMIT\n")
    *creation, main, rest = sections
    assert rest == ""
    created = [line[1:].split()[0] for s in creation for line in s.splitlines()[1:]]
    assert len(creation) == -(-len(target.chains) // 500)
    assert sorted(created) == sorted(target.chains)
    assert created != sorted(created)
    assert created != sorted(created, reverse=True)
    assert all(line.startswith(("*nat", ":")) for s in creation for line in s.splitlines())
    assert {line[1:].split()[0] for line in main.splitlines() if line[:1] == ":"} == set(created)
    small = render(state_of({VirtualServer(KEY): RS}), {}, version=4)
    assert transaction(Saved(), small, jumps=JUMPS).count("COMMIT") == 1


# ---- IPVSPX-FORWARD: the filter table's forwarding chain ---------------------------------
# Issue 15 item 3 on the iptables fallback: IPVSPX-FORWARD (kube-proxy's KUBE-FORWARD in
# iptables mode) rendered from the same policy as the IPVS firewall's IPVSPROXY-FORWARD.


def test_the_forward_chain_drops_invalid_and_accepts_marked_and_established():
    assert filter_ruleset().chains == {
        FORWARD: (
            "-A IPVSPX-FORWARD -m conntrack --ctstate INVALID -j DROP",
            '-A IPVSPX-FORWARD -m comment --comment "ipvsproxy forwarding rules" '
            "-m mark --mark 0x4000/0x4000 -j ACCEPT",
            '-A IPVSPX-FORWARD -m comment --comment "ipvsproxy forwarding conntrack rule" '
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        )
    }
    assert "0x2000/0x2000" in filter_ruleset(NodePolicy(masquerade_bit=13)).chains[FORWARD][1]
    assert len(filter_ruleset(NodePolicy(conntrack_tcp_liberal=True)).chains[FORWARD]) == 2


def test_both_backends_forward_alike():
    nodes = (NodePolicy(), NodePolicy(masquerade_bit=3), NodePolicy(conntrack_tcp_liberal=True))
    for node in nodes:
        ours = filter_ruleset(node).chains[FORWARD]
        theirs = firewall_render(4, node)["filter"].chains[COMPANION_FORWARD]
        assert [r.replace(FORWARD, "X") for r in ours] == [
            r.replace(COMPANION_FORWARD, "X") for r in theirs
        ]


def test_written_once_then_nothing_to_do_repaired_when_damaged_and_removed_by_cleanup():
    cold = transaction(Saved(), filter_ruleset(), table="filter", jumps=FILTER_JUMPS)
    lines = cold.splitlines()
    assert lines[0] == "*filter"
    jump = '-I FORWARD 1 -m comment --comment "ipvsproxy forwarding rules" -j IPVSPX-FORWARD'
    assert jump in lines
    assert lines.index(":IPVSPX-FORWARD - [0:0]") < lines.index(jump)
    save = "\n".join(
        [
            "*filter",
            ":FORWARD DROP [0:0]",
            ":DOCKER-USER - [0:0]",
            ":IPVSPX-FORWARD - [0:0]",
            jump.replace("-I FORWARD 1", "-A FORWARD"),
            "-A FORWARD -j DOCKER-USER",
            *filter_ruleset().chains[FORWARD],
            "COMMIT",
        ]
    )
    saved = parse_save(save, table="filter", owns=owned_filter)
    assert set(saved.chains) == {FORWARD}  # DOCKER-USER is not ours
    assert not damage(saved, filter_ruleset(), jumps=FILTER_JUMPS)
    assert not transaction(saved, filter_ruleset(), table="filter", jumps=FILTER_JUMPS)
    hurt = Saved({FORWARD: saved.chains[FORWARD][1:]}, ())
    assert damage(hurt, filter_ruleset(), jumps=FILTER_JUMPS) == (
        "chain IPVSPX-FORWARD differs (1 rules missing, 0 unexpected)",
        "0 jumps from FORWARD where 1 belongs",
    )
    fix = transaction(hurt, filter_ruleset(), table="filter", jumps=FILTER_JUMPS)
    assert "-A IPVSPX-FORWARD -m conntrack --ctstate INVALID -j DROP" in fix
    assert jump in fix
    gone = removal(saved, table="filter").splitlines()
    assert gone[0] == "*filter"
    assert gone.index(jump.replace("-I FORWARD 1", "-D FORWARD")) < gone.index("-X IPVSPX-FORWARD")
    assert not any("DOCKER-USER" in line for line in gone)
