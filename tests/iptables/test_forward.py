"""Issue 15 item 3 on the iptables fallback: IPVSPX-FORWARD (kube-proxy's KUBE-FORWARD in
iptables mode) rendered from the same policy as the IPVS firewall's IPVSPROXY-FORWARD."""

from __future__ import annotations

from ipvsproxy.firewall.rules import FORWARD as COMPANION_FORWARD
from ipvsproxy.firewall.rules import render as firewall_render
from ipvsproxy.iptables.parse import Saved, parse_save
from ipvsproxy.iptables.rules import FILTER_JUMPS, FORWARD, PREFIX, filter_ruleset
from ipvsproxy.iptables.transaction import damage, removal, transaction
from ipvsproxy.policy import NodePolicy


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
    saved = parse_save(save, table="filter", prefix=PREFIX)
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
