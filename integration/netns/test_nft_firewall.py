"""The nftables firewall against this host's kernel, in a throw-away network namespace: the
whole table written in one transaction and read back as written, a refused transaction
changing nothing, nobody else's table ever touched, and an idle observation that asks
nftables nothing (the generation counter); through libnftables and through the `nft` tool."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from ipaddress import ip_network

import pytest

from integration.lab import inside
from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.firewall_plan import FirewallPlan
from ipvsproxy.firewall.ipset import SetChange
from ipvsproxy.firewall.nft_firewall import NftFirewall
from ipvsproxy.firewall.sets import SetState, all_sets
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.generation import RulesetGeneration
from ipvsproxy.policy import LocalMode, NodePolicy

pytestmark = pytest.mark.netns

OPTIONS = NodePolicy(local_mode=LocalMode.CLUSTER_CIDR, local_cidrs=(ip_network("10.244.0.0/16"),))
ENTRIES = {
    "IPVSPROXY-CLUSTER-IP": {"10.96.0.1,tcp:443", "10.96.0.10,udp:53", "10.96.0.11,sctp:9"},
    "IPVSPROXY-CLUSTER-IP-6": {"fd00:96::1,tcp:443"},
    "IPVSPROXY-VIPS": {"10.96.0.1", "10.96.0.10"},
    "IPVSPROXY-LOOP-BACK": {"10.244.1.2,tcp:8080,10.244.1.2"},
    "IPVSPROXY-LB-SOURCE": {"203.0.113.10,tcp:80,10.0.0.0/8", "203.0.113.10,tcp:80,192.0.2.7"},
    "IPVSPROXY-LB-SOURCE-6": {"2001:db8::10,tcp:80,2001:db8:1::/48"},
}


def wanted(entries: dict[str, set[str]]) -> SetState:
    return SetState(
        {name: (kind, v, frozenset(entries.get(name, ()))) for name, kind, v in all_sets()}
    )


COUNT = [0]  # the transactions and readings sent to nftables


def nft(netns: str, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["ip", "netns", "exec", netns, "nft", *args], input=stdin,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(params=["libnftables", "nft"])
def firewall(netns: str, request: pytest.FixtureRequest) -> Iterator[NftFirewall]:
    """The firewall in the namespace, through libnftables (opened there: it stays bound to
    it) or through the tool (`ip netns exec`), its calls to nftables counted."""
    with inside(netns):
        if request.param == "nft":
            made = NftFirewall(
                options=OPTIONS, commands=Commands(prefix=("ip", "netns", "exec", netns))
            )
        else:
            made = NftFirewall(options=OPTIONS)
        made.check()
        made.generation = made.generation or RulesetGeneration.open()
    assert made.nft.name == request.param
    runner = made.nft
    run, list_json = runner.run, runner.list_json

    def counted_run(script: str, *, check: bool = False) -> None:
        COUNT[0] += 1
        run(script, check=check)

    def counted_list(*words: str) -> str:
        COUNT[0] += 1
        return list_json(*words)

    runner.run, runner.list_json = counted_run, counted_list  # type: ignore[method-assign]
    try:
        yield made
    finally:
        made.close()


def test_the_table_is_written_in_one_transaction_and_read_back_as_written(firewall, netns):
    plan = firewall.plan(wanted(ENTRIES))
    COUNT[0] = 0
    firewall.apply(plan)
    assert COUNT[0] == 1  # one transaction (the generation is read over netlink)
    seen = firewall.observe().sets.sets
    for name, kind, version in all_sets():
        assert seen[name] == (kind, version, frozenset(ENTRIES.get(name, ()))), name
    assert not firewall.plan(wanted(ENTRIES))  # nothing left to write
    listed = nft(netns, "list", "table", "inet", "ipvsproxy")
    assert "type nat hook prerouting priority dstnat; policy accept;" in listed
    assert "ip saddr != 10.244.0.0/16" in listed


def test_an_idle_observation_reads_nothing_and_anyone_s_commit_makes_it_read(firewall, netns):
    firewall.apply(firewall.plan(wanted(ENTRIES)))
    firewall.observe()
    COUNT[0] = 0
    firewall.observe()
    firewall.observe()
    assert COUNT[0] == 0
    nft(netns, "add", "table", "ip", "someone")  # another table: the counter moves
    firewall.observe()
    assert COUNT[0] == 1


def test_element_changes_between_full_passes(firewall):
    firewall.apply(firewall.plan(wanted(ENTRIES)))
    change = SetChange("IPVSPROXY-CLUSTER-IP", "hash:ip,port", 4, add=("10.96.0.12,tcp:80",),
                       delete=("10.96.0.1,tcp:443",))  # fmt: skip
    assert firewall.write_sets([change]) == 2
    firewall._known = None  # read the table itself, not what the firewall believes
    after = firewall.observe().sets.sets["IPVSPROXY-CLUSTER-IP"][2]
    assert after == {"10.96.0.10,udp:53", "10.96.0.11,sctp:9", "10.96.0.12,tcp:80"}


def test_a_refused_transaction_changes_nothing(firewall, netns):
    firewall.apply(firewall.plan(wanted(ENTRIES)))
    before = nft(netns, "list", "table", "inet", "ipvsproxy")
    bad = SetChange("IPVSPROXY-LB-SOURCE", "hash:ip,port,net", 4,
                    add=("203.0.113.10,tcp:80,10.1.0.0/16",))  # fmt: skip # overlaps 10.0.0.0/8
    good = SetChange("IPVSPROXY-VIPS", "hash:ip", 4, add=("10.96.0.99",))
    with pytest.raises(KernelError):
        firewall.apply(FirewallPlan((good, bad), tool="nft"))
    assert nft(netns, "list", "table", "inet", "ipvsproxy") == before


def test_nobody_else_s_table_is_read_changed_or_removed(firewall, netns):
    theirs = (
        "add table ip kube-proxy\n"
        "add set ip kube-proxy cluster-ips { type ipv4_addr; }\n"
        "add element ip kube-proxy cluster-ips { 10.96.0.1 }\n"
        "add table inet other\n"
        "add set inet other cluster-ip { type ipv4_addr . inet_proto . inet_service; }\n"
        "add chain inet other nat-prerouting { type nat hook prerouting priority dstnat; }\n"
    )
    nft(netns, "-f", "-", stdin=theirs)
    before = {t: nft(netns, "list", "table", *t.split()) for t in ("ip kube-proxy", "inet other")}
    seen = firewall.observe()
    assert seen.sets.sets == {}  # ours is not there yet
    assert seen.chains == {}
    firewall.apply(firewall.plan(wanted(ENTRIES)))
    removed = firewall.cleanup()
    assert removed[0] == "nft table inet ipvsproxy"
    tables = json.loads(nft(netns, "-j", "list", "tables"))["nftables"]
    names = {(t["table"]["family"], t["table"]["name"]) for t in tables if "table" in t}
    assert names == {("ip", "kube-proxy"), ("inet", "other")}
    for table, text in before.items():
        assert nft(netns, "list", "table", *table.split()) == text
    assert firewall.cleanup() == []


@pytest.mark.parametrize(("policy", "chosen"), [("ACCEPT", "nftables"), ("DROP", "iptables")])
def test_auto_keeps_iptables_where_the_iptables_forward_policy_drops(netns, policy, chosen):
    """An ACCEPT in another table cannot overrule iptables' FORWARD DROP (Docker's): the
    replies IPVS forwards back to pods would be lost, so auto stays with iptables there."""
    from ipvsproxy.backends import _firewall
    from ipvsproxy.config import Config

    subprocess.run(["ip", "netns", "exec", netns, "iptables", "-P", "FORWARD", policy], check=True)
    with inside(netns):
        firewall, why = _firewall(Config(), Commands(prefix=("ip", "netns", "exec", netns)))
    assert firewall is not None
    try:
        assert firewall.name == chosen
        if policy == "DROP":
            assert "the iptables FORWARD policy is DROP" in why
    finally:
        firewall.close()


def test_switching_to_nftables_copies_the_record_first_and_removes_iptables_after(netns):
    """The record of virtual servers made on node addresses (ownership rule 5) is copied
    into the new firewall before its first pass; the old rules stay until the new ones are
    written (no moment without either), then go."""
    from ipvsproxy.backends import adopt_records, retire_other_firewall
    from ipvsproxy.firewall.host_firewall import Firewall

    old = Firewall(commands=Commands(prefix=("ip", "netns", "exec", netns)))
    old.check()
    record = {"IPVSPROXY-CREATED": {"192.168.1.10,tcp:30080"}}
    old.apply(old.plan(wanted(record)))
    with inside(netns):  # every tool run from here runs in the namespace
        new = NftFirewall()
        new.check()
        try:
            adopt_records(new)
            moved = new.observe_sets().sets["IPVSPROXY-CREATED"][2]
            kept = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
            new.apply(new.plan(wanted(record)))  # the first pass
            removed = retire_other_firewall(new)
        finally:
            new.close()
    assert moved == {"192.168.1.10,tcp:30080"}
    assert "IPVSPROXY-FILTER" in kept  # still there before the first pass
    assert "ipset IPVSPROXY-CREATED" in removed
    saved = subprocess.run(["ip", "netns", "exec", netns, "iptables-save"], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    assert "IPVSPROXY" not in saved
