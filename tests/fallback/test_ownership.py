"""Ownership by exact names and rules read by tokens (issue 28, items 1 and 4): a chain or
set of someone else named like ours is never read, flushed or deleted; a rule of someone
else that jumps into a chain of ours no longer wanted keeps that chain (emptied), the rest
of the pass goes in and the conflict is named in one warning; a comment is never a target."""

from __future__ import annotations

import logging

from ipvsproxy.fallback import IptablesKernel
from ipvsproxy.fallback.chains import owned, svc_chain
from ipvsproxy.firewall.host_firewall import Firewall, plan_firewall
from ipvsproxy.firewall.ipset import parse_ipset_save, parse_names
from ipvsproxy.firewall.rules import Options
from ipvsproxy.firewall.sets import SetState
from ipvsproxy.iptables.parse import parse_save, target, tokens
from ipvsproxy.kpcleanup import selected
from ipvsproxy.model import DeleteService, UpdateDest
from ipvsproxy.sync.plan import plan
from tests.fallback.test_kernel import EVERYTHING, KEYS, RS, STATE, loaded
from tests.support import FakeIptables

FOREIGN_JUMP = "-s 192.0.2.0/24 -j IPVSPX-X"
FOREIGN_CHAIN = ["-s 192.0.2.7/32 -j ACCEPT"]


def test_a_foreign_chain_named_like_ours_is_never_claimed():
    """The issue's node: `iptables -t nat -N IPVSPX-X; -A PREROUTING ... -j IPVSPX-X`. Before,
    the chain was taken for a stray of ours and deleted, and the transaction (refused:
    CHAIN_DEL busy) wrote no Service rule."""
    commands = FakeIptables()
    commands.tables[4]["IPVSPX-X"] = list(FOREIGN_CHAIN)
    commands.tables[4]["IPVSPX-SVC-mine"] = []  # not a name the renderer makes either
    commands.tables[4]["PREROUTING"].append(FOREIGN_JUMP)
    kernel = IptablesKernel(commands=commands)
    observed = kernel.observe()
    assert not [d for d in kernel.damage() if "IPVSPX-X" in d or "mine" in d]
    assert kernel.apply(plan(STATE, observed, ownership=EVERYTHING)).ok
    assert IptablesKernel(commands=commands).observe() == STATE
    kernel.cleanup()
    assert commands.tables[4]["IPVSPX-X"] == FOREIGN_CHAIN
    assert "IPVSPX-SVC-mine" in commands.tables[4]
    assert FOREIGN_JUMP in commands.tables[4]["PREROUTING"]
    assert "IPVSPX-SERVICES" not in commands.tables[4]


def test_a_foreign_jump_into_a_chain_of_ours_keeps_it_emptied_and_the_rest_goes_in(caplog):
    """Before, deleting the chain made the whole restore fail: no operation of the pass
    went in, and every pass after failed the same way."""
    kernel, commands = loaded()
    doomed = svc_chain(KEYS[0])
    commands.tables[4]["OTHER"] = [f"-m comment --comment mine -j {doomed}"]
    change = UpdateDest(KEYS[1], RS[0].__class__(RS[0].key, weight=5))
    with caplog.at_level(logging.WARNING):
        report = kernel.apply([DeleteService(KEYS[0]), change])
    assert report.ok, report.failures
    assert commands.tables[4][doomed] == []  # kept for the rule of others, emptied
    assert commands.tables[4]["OTHER"] == [f"-m comment --comment mine -j {doomed}"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert doomed in warnings[0]
    assert f"-A OTHER -m comment --comment mine -j {doomed}" in warnings[0]
    seen = IptablesKernel(commands=commands).observe()
    assert KEYS[0] not in seen.services
    assert seen.dests[KEYS[1]][RS[0].key].weight == 5
    caplog.clear()
    kernel.observe()  # a full resync: the kept chain is no damage, nothing said again
    assert kernel.damage() == ()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    commands.tables[4]["OTHER"] = []  # the other owner lets go: the next sync deletes it
    kernel.observe()
    assert kernel.damage()
    assert kernel.apply([]).ok
    assert doomed not in commands.tables[4]


def test_the_firewall_claims_only_its_exact_chain_and_set_names():
    """IPVS mode's rules and sets: IPVSPROXY-X and IPVSPROXY-MINE are someone else's."""
    commands = FakeIptables()
    commands.tables[4]["IPVSPROXY-X"] = list(FOREIGN_CHAIN)
    commands.tables[4]["PREROUTING"].append("-j IPVSPROXY-X")
    commands.filters[4]["IPVSPROXY-FILTERS"] = []
    firewall = Firewall(commands=commands, versions=(4,))
    chains = firewall.observe_chains()
    assert "IPVSPROXY-X" not in chains[4, "nat"].chains
    assert "IPVSPROXY-FILTERS" not in chains[4, "filter"].chains
    assert chains[4, "nat"].jumps == ()
    from ipvsproxy.firewall.host_firewall import Observed

    wanted = SetState({})
    planned = plan_firewall(wanted, Observed(SetState({}), chains), Options(), (4,))
    assert planned.restores
    assert not any("IPVSPROXY-X" in p or "FILTERS" in p for _, _, p in planned.restores)
    assert parse_names("IPVSPROXY-MINE\nIPVSPROXY-VIPS\nIPVSPROXY-VIPS-6-T\n") == [
        "IPVSPROXY-VIPS",
        "IPVSPROXY-VIPS-6-T",
    ]
    save = "create IPVSPROXY-MINE hash:ip family inet\nadd IPVSPROXY-MINE 192.0.2.1\n"
    assert parse_ipset_save(save).sets == {}
    seen = SetState({"IPVSPROXY-VIPS-T": ("hash:ip", 4, frozenset())})
    stale = plan_firewall(SetState({}), Observed(seen, chains), Options(), (4,)).stale_sets
    assert stale == ("IPVSPROXY-VIPS-T",)  # a temporary of ours left by a crash: destroyed


SAVE = r"""*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:KUBE-FORWARD - [0:0]
-A INPUT -s 192.0.2.0/24 -m comment --comment "-j KUBE-FORWARD via" -j DROP
-A INPUT -m comment --comment -j -j DROP
-A INPUT -m comment --comment "x\\y \'q" -j DROP
-A FORWARD -m comment --comment "a\" -j ACCEPT \"b" -j KUBE-FORWARD
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
"""


def test_a_comment_naming_a_chain_is_no_jump_and_a_comment_hiding_quotes_hides_no_jump():
    """As iptables-save 1.8.9 prints these rules (checked on this host). Before, the first
    rule was taken for a jump into KUBE-FORWARD (cleanup deleted it, opening the firewall)
    and the last one was missed (`-j ACCEPT` read inside its comment: cleanup then failed
    with CHAIN_DEL busy)."""
    saved = selected(SAVE, "filter")
    assert saved.jumps == (
        ("FORWARD", r'-m comment --comment "a\" -j ACCEPT \"b" -j KUBE-FORWARD'),
    )
    assert set(saved.chains) == {"KUBE-FORWARD"}


def test_rules_are_read_word_by_word_as_iptables_restore_reads_them():
    assert tokens(r'-m comment --comment "a\" -j ACCEPT \"b" -j X') == [
        "-m", "comment", "--comment", 'a" -j ACCEPT "b', "-j", "X",
    ]  # fmt: skip
    assert tokens(r'--comment "x\\y \'q" -j DROP') == ["--comment", "x\\y 'q", "-j", "DROP"]
    assert target("-m comment --comment -j -j DROP") == "DROP"
    assert target('-m comment --comment "-j KUBE-FORWARD via" -j DROP') == "DROP"
    assert target("-s 192.0.2.0/24 -g IPVSPX-SERVICES") == "IPVSPX-SERVICES"
    assert target('-m comment --comment "no target"') == ""
    text = '*nat\n:IPVSPX-SERVICES - [0:0]\n-A OUTPUT -m comment --comment "-j IPVSPX-SERVICES" -j DROP\nCOMMIT\n'  # noqa: E501
    assert parse_save(text, owns=owned).jumps == ()
