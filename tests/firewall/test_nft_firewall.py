"""The nftables firewall (firewall/nft_firewall.py) without a kernel: its rules against the
iptables chains they replace, rule for rule; the entries' translation both ways; what a plan
writes against what the table holds; one transaction per pass; the generation cache."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv6Address, ip_network
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.ipset import SetChange
from ipvsproxy.firewall.nft_firewall import (
    NftFirewall,
    _comment_of,
    entry_of,
    parse_table,
    render_chains,
)
from ipvsproxy.firewall.rules import render
from ipvsproxy.firewall.sets import NFT_NAMES, SetState, all_sets, nft_element
from ipvsproxy.policy import Frontend, LocalMode, NodePolicy

# ---- the rules, rule for rule ----------------------------------------------------------

# the iptables chains and the nftables chain holding the same rules (of both IP versions)
PAIRS = {
    ("nat", "IPVSPROXY-SERVICES"): "nat-prerouting",
    ("nat", "IPVSPROXY-OUTPUT"): "nat-output",
    ("nat", "IPVSPROXY-POSTROUTING"): "nat-postrouting",
    ("filter", "IPVSPROXY-FILTER"): "filter-input",
    ("filter", "IPVSPROXY-FORWARD"): "filter-forward",
}
# how each spells "this field of the packet, looked up in this set"
DIRECTIONS = {
    "daddr . meta l4proto . th dport": "dst,dst",
    "saddr . meta l4proto . th dport": "src,dst",
    "daddr . meta l4proto . th dport . ip saddr": "dst,dst,src",
    "daddr . meta l4proto . th dport . ip6 saddr": "dst,dst,src",
    "daddr": "dst",
}
VERDICTS = {  # iptables target -> nftables statement
    "IPVSPROXY-MARK-MASQ": "meta mark set meta mark |",
    "MASQUERADE": "masquerade",
    "RETURN": "return",
    "DROP": "drop",
    "ACCEPT": "accept",
    "REJECT": "reject",
}

policies = st.builds(
    NodePolicy,
    masquerade_bit=st.integers(0, 31),
    masquerade_all=st.booleans(),
    local_mode=st.sampled_from(list(LocalMode)),
    local_cidrs=st.sampled_from(
        [(), (ip_network("10.244.0.0/16"),), (ip_network("10.244.0.0/16"), ip_network("fd00::/64"))]
    ),
    interface=st.sampled_from(["cbr0", "veth"]),
    conntrack_tcp_liberal=st.booleans(),
)


def iptables_lookups(rule: str) -> list[tuple[str, str, bool]]:
    """(nft set name, directions, negated) of each set match of an iptables rule."""
    found = re.findall(r"-m set (! )?--match-set (\S+) (\S+)", rule)
    return [(NFT_NAMES[name], dirs, bool(neg)) for neg, name, dirs in found]


def nft_lookups(rule: str) -> list[tuple[str, str, bool]]:
    """The same of an nftables rule."""
    found = re.findall(r"ip6? ((?:\w+(?: \. (?:ip6? |meta |th )?\w+)*)) (!= )?@(\S+)", rule)
    return [(name, DIRECTIONS[fields], bool(neg)) for fields, neg, name in found]


def iptables_verdict(rule: str) -> str:
    target = rule.split(" -j ")[-1].split()[0]
    if target == "MARK":  # the mark cleared: --set-xmark 0x0/BIT
        return "meta mark set meta mark &"
    return VERDICTS[target]


@given(policies)
def test_every_iptables_rule_has_its_nftables_twin(options: NodePolicy) -> None:
    """Per chain, the same set lookups (set, directions, negation), the same verdicts and
    the same non-set matches (the masquerade's local detection, the mark, conntrack), over
    both IP versions: the nftables table is the iptables chains, rule for rule."""
    chains = {chain.name: chain.rules for chain in render_chains(options)}
    iptables = {4: render(4, options), 6: render(6, options)}
    for (table, name), nft_name in PAIRS.items():
        want: Counter[tuple[Any, ...]] = Counter()
        for version in (4, 6):
            for rule in iptables[version][table].chains[name]:
                if "-j IPVSPROXY-MARK-MASQ" in rule or "--match-set" in rule or version == 4:
                    want[_shape_iptables(rule)] += 1
        have = Counter(_shape_nft(rule) for rule in chains[nft_name])
        assert have == want, nft_name


def _shape_iptables(rule: str) -> tuple[Any, ...]:
    outside = re.search(r"! -s (\S+)|! -i (\S+)", rule)
    extra = ""
    if outside:
        extra = outside.group(1) or outside.group(2).replace("+", "*")
    if "--ctstate" in rule:
        extra += " ct " + rule.split("--ctstate ")[1].split()[0].lower()
    if "-m mark" in rule:
        extra += " mark"
    return (tuple(iptables_lookups(rule)), iptables_verdict(rule), extra.strip())


def _shape_nft(rule: str) -> tuple[Any, ...]:
    body = rule.rpartition(' comment "')[0]
    outside = re.search(r'saddr != (\d\S+|[0-9a-f:]+/\d+) |iifname != "(\S+)" ', body)
    extra = ""
    if outside:
        extra = outside.group(1) or outside.group(2)
    if "ct state" in body:
        extra += " ct " + body.split("ct state ")[1].split()[0].lower()
    if re.search(r"meta mark & 0x\w+ [!=]=", body):
        extra += " mark"
    verdict = next(v for v in (*VERDICTS.values(), "meta mark set meta mark &") if v in body)
    return (tuple(nft_lookups(body)), verdict, extra.strip())


def test_the_forward_chain_drops_invalid_packets_unless_conntrack_is_liberal() -> None:
    strict = {c.name: c.rules for c in render_chains(NodePolicy())}["filter-forward"]
    liberal = {c.name: c.rules for c in render_chains(NodePolicy(conntrack_tcp_liberal=True))}
    assert strict[0].startswith("ct state invalid drop")
    assert not any("invalid" in rule for rule in liberal["filter-forward"])


def test_without_local_detection_only_the_node_s_vip_sourced_traffic_is_masqueraded() -> None:
    chains = {c.name: c.rules for c in render_chains(NodePolicy())}
    assert not any("@cluster-ip" in rule for rule in chains["nat-prerouting"])
    vip_sourced = [
        r for r in chains["nat-output"] if "saddr . meta l4proto . th dport @cluster" in r
    ]
    assert len(vip_sourced) == 2  # IPv4 and IPv6


def test_each_rule_carries_a_digest_of_itself() -> None:
    """A rule's comment changes exactly when the rule does."""

    def comments(options: NodePolicy) -> dict[tuple[str, str], str]:
        return {(c.name, _comment_of(r)): r for c in render_chains(options) for r in c.rules}

    before, after = comments(NodePolicy()), comments(NodePolicy(masquerade_bit=13))
    assert len(before) == sum(len(c.rules) for c in render_chains(NodePolicy()))  # per chain
    kept = before.keys() & after.keys()
    assert kept
    assert all(before[c] == after[c] for c in kept)
    assert all("0x4000" in before[c] or "0xffffbfff" in before[c] for c in before.keys() - kept)


# ---- entries and elements ----------------------------------------------------------------

addresses = st.one_of(
    st.builds(IPv4Address, st.integers(0, 2**32 - 1)),
    st.builds(IPv6Address, st.integers(0, 2**128 - 1)),
)


@given(addresses, st.sampled_from(["tcp", "udp", "sctp"]), st.integers(1, 65535),
       st.integers(0, 128), st.sampled_from(["hash:ip", "hash:ip,port", "hash:ip,port,ip",
                                              "hash:ip,port,net"]))  # fmt: skip
def test_an_entry_survives_the_way_to_nftables_and_back(address, proto, number, length, kind):
    """`ipset save`'s text -> the element nft is given -> nft -j's JSON of it -> the text."""
    net = ip_network(f"{address}/{min(length, address.max_prefixlen)}", strict=False)
    last = str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)
    entry = {
        "hash:ip": str(address),
        "hash:ip,port": f"{address},{proto}:{number}",
        "hash:ip,port,ip": f"{address},{proto}:{number},{address}",
        "hash:ip,port,net": f"{address},{proto}:{number},{last}",
    }[kind]
    parts = nft_element(entry).split(" . ")
    if kind == "hash:ip":
        shown: Any = parts[0]
    else:
        tail: list[Any] = []
        if kind == "hash:ip,port,ip":
            tail = [parts[3]]
        elif kind == "hash:ip,port,net":  # nft prints a full-length prefix as an address
            addr, _, bits = parts[3].partition("/")
            tail = [{"prefix": {"addr": addr, "len": int(bits)}} if bits else addr]
        shown = {"concat": [parts[0], parts[1], int(parts[2]), *tail]}
    assert entry_of(shown) == entry


def test_a_protocol_nft_prints_by_number_is_named() -> None:
    assert entry_of({"concat": ["10.0.0.1", 132, 80]}) == "10.0.0.1,sctp:80"


def test_overlapping_source_ranges_become_one_element() -> None:
    """An interval set refuses overlapping elements (nft: File exists)."""
    from ipvsproxy.firewall.sets import entries_for
    from ipvsproxy.model import Proto, VSKey
    from ipvsproxy.policy import Frontend, FrontendPolicy, Masquerade

    key = VSKey(IPv4Address("203.0.113.10"), 80, Proto.TCP)
    nets = (ip_network("10.0.0.0/8"), ip_network("10.1.0.0/16"), ip_network("192.0.2.7/32"))
    policy = FrontendPolicy(Frontend.LOAD_BALANCER, Masquerade.ALWAYS, nets)
    made = entries_for(key, None, (), local=(), bound=True, policy=policy)
    sources = {entry for name, entry in made if name == "IPVSPROXY-LB-SOURCE"}
    assert sources == {"203.0.113.10,tcp:80,10.0.0.0/8", "203.0.113.10,tcp:80,192.0.2.7"}


# ---- plans and transactions against a table ---------------------------------------------


class FakeCommands:
    """`Commands` that answer `nft -j list table` from `table` and keep what was run."""

    prefix: tuple[str, ...] = ()

    def __init__(self, table: str | None = None, *, refuse: str = "") -> None:
        self.table = table
        self.refuse = refuse
        self.runs: list[tuple[tuple[str, ...], str | None]] = []

    def run(self, args: Sequence[str], *, stdin: str | None = None) -> str:
        self.runs.append((tuple(args), stdin))
        if self.refuse and stdin is not None and self.refuse in stdin:
            raise KernelError("nft failed: Error: Could not process rule: File exists")
        if list(args[:3]) == ["nft", "-j", "list"]:
            if self.table is None:
                raise KernelError("nft failed: Error: No such file or directory")
            return self.table
        return ""


class FakeGeneration:
    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def current(self) -> int:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]

    def close(self) -> None:
        pass


def table_json(options: NodePolicy, sets: dict[str, list[Any]] | None = None,
               chains: Sequence[Any] | None = None) -> str:  # fmt: skip
    """What `nft -j list table inet ipvsproxy` prints of a table this version wrote."""
    items: list[dict[str, Any]] = [{"metainfo": {"json_schema_version": 1}},
                                   {"table": {"family": "inet", "name": "ipvsproxy"}}]  # fmt: skip
    for name, _, _ in all_sets():
        found: dict[str, Any] = {"family": "inet", "name": NFT_NAMES[name], "table": "ipvsproxy"}
        if sets and sets.get(name):
            found["elem"] = sets[name]
        items.append({"set": found})
    for chain in chains if chains is not None else render_chains(options):
        items.append({"chain": {"family": "inet", "table": "ipvsproxy", "name": chain.name,
                                "type": chain.kind, "hook": chain.hook, "prio": chain.priority,
                                "policy": "accept"}})  # fmt: skip
        for rule in chain.rules:
            items.append({"rule": {"chain": chain.name, "comment": _comment_of(rule)}})
    return json.dumps({"nftables": items})


def empty_wanted() -> SetState:
    return SetState({name: (kind, version, frozenset()) for name, kind, version in all_sets()})


def test_a_table_that_holds_what_is_wanted_needs_no_transaction() -> None:
    options = NodePolicy()
    firewall = NftFirewall(options=options, commands=FakeCommands(table_json(options)))  # type: ignore[arg-type]
    assert not firewall.plan(empty_wanted())


def test_a_first_plan_writes_the_whole_table_in_one_transaction() -> None:
    commands = FakeCommands(None)
    firewall = NftFirewall(commands=commands)  # type: ignore[arg-type]
    wanted = {
        **empty_wanted().sets,
        "IPVSPROXY-CLUSTER-IP": ("hash:ip,port", 4, frozenset({"10.96.0.1,tcp:443"})),
    }
    plan = firewall.plan(SetState(wanted))
    assert len([c for c in plan.sets if c.create]) == len(list(all_sets()))
    firewall.apply(plan)
    writes = [str(stdin) for args, stdin in commands.runs if args == ("nft", "-f", "-")]
    assert len(writes) == 1
    lines = writes[0].splitlines()
    assert lines[0] == "add table inet ipvsproxy"
    first_chain = next(i for i, line in enumerate(lines) if line.startswith("add chain"))
    last_set = max(i for i, line in enumerate(lines) if line.startswith("add set"))
    assert last_set < first_chain  # the sets the rules look up exist first
    assert lines[-1] == "add element inet ipvsproxy cluster-ip { 10.96.0.1 . tcp . 443 }"


def test_a_changed_rule_rewrites_its_chain_only() -> None:
    options = NodePolicy()
    table = table_json(options)
    moved = NodePolicy(masquerade_bit=13)  # the mark: postrouting and forward change
    firewall = NftFirewall(options=moved, commands=FakeCommands(table))  # type: ignore[arg-type]
    script = firewall.plan(empty_wanted()).script
    flushed = [line.split()[-1] for line in script if line.startswith("flush chain")]
    assert sorted(flushed) == ["filter-forward", "nat-output", "nat-postrouting", "nat-prerouting"]
    assert not any(line.startswith(("delete", "add chain")) for line in script)


def test_a_chain_on_another_hook_is_made_again_and_an_unknown_one_goes() -> None:
    options = NodePolicy()
    chains = list(render_chains(options))
    from dataclasses import replace

    chains[3] = replace(chains[3], priority=-150)
    stale = replace(chains[0], name="nat-old")
    firewall = NftFirewall(commands=FakeCommands(table_json(options, chains=[*chains, stale])))  # type: ignore[arg-type]
    script = firewall.plan(empty_wanted()).script
    assert script[0] == "delete chain inet ipvsproxy filter-input"
    assert script[1].startswith("add chain inet ipvsproxy filter-input { type filter hook input")
    assert script[-1] == "delete chain inet ipvsproxy nat-old"


def test_a_set_the_table_holds_but_this_version_does_not_make_is_removed() -> None:
    options = NodePolicy()
    listed = json.loads(table_json(options))
    listed["nftables"].append({"set": {"family": "inet", "name": "old-set", "table": "ipvsproxy"}})
    firewall = NftFirewall(commands=FakeCommands(json.dumps(listed)))  # type: ignore[arg-type]
    plan = firewall.plan(empty_wanted())
    assert plan.stale_sets == ("old-set",)
    commands = FakeCommands(json.dumps(listed))
    NftFirewall(commands=commands).apply(plan)  # type: ignore[arg-type]
    assert str(commands.runs[-1][1]).splitlines()[-1] == "delete set inet ipvsproxy old-set"


def test_the_entries_the_table_holds_are_read_back_in_ipset_s_spelling() -> None:
    options = NodePolicy()
    sets: dict[str, list[Any]] = {
        "IPVSPROXY-CLUSTER-IP": [{"concat": ["10.96.0.1", "tcp", 443]}],
        "IPVSPROXY-VIPS-6": ["fd00::1"],
        "IPVSPROXY-LB-SOURCE": [
            {"concat": ["203.0.113.1", "tcp", 80, {"prefix": {"addr": "10.0.0.0", "len": 8}}]},
            {"concat": ["203.0.113.1", "tcp", 80, "192.0.2.7"]},
        ],
    }
    seen = parse_table(table_json(options, sets)).sets.sets
    assert seen["IPVSPROXY-CLUSTER-IP"] == ("hash:ip,port", 4, frozenset({"10.96.0.1,tcp:443"}))
    assert seen["IPVSPROXY-VIPS-6"][2] == {"fd00::1"}
    assert seen["IPVSPROXY-LB-SOURCE"][2] == {"203.0.113.1,tcp:80,10.0.0.0/8",
                                             "203.0.113.1,tcp:80,192.0.2.7"}  # fmt: skip


def test_output_that_is_not_nft_s_json_is_an_error_not_a_traceback() -> None:
    with pytest.raises(KernelError, match="not the JSON expected"):
        parse_table("Error: something")


# ---- the generation cache -----------------------------------------------------------------


def lists(commands: FakeCommands) -> int:
    return sum(1 for args, _ in commands.runs if args[:3] == ("nft", "-j", "list"))


def test_an_idle_resync_reads_the_table_only_when_something_was_committed() -> None:
    commands = FakeCommands(table_json(NodePolicy()))
    firewall = NftFirewall(commands=commands, generation=FakeGeneration(7, 7, 9))  # type: ignore[arg-type]
    firewall.observe()
    firewall.observe()
    assert lists(commands) == 1
    firewall.observe()  # someone committed (9): read again
    assert lists(commands) == 2


def test_after_its_own_write_alone_the_table_is_known_without_reading_it() -> None:
    commands = FakeCommands(table_json(NodePolicy()))
    # observe at 7; the write: 7 before, 8 after (ours alone); then 8 for the next observe
    firewall = NftFirewall(commands=commands, generation=FakeGeneration(7, 7, 8, 8))  # type: ignore[arg-type]
    firewall.observe()
    change = SetChange("IPVSPROXY-CLUSTER-IP", "hash:ip,port", 4, add=("10.96.0.9,udp:53",))
    assert firewall.write_sets([change]) == 1
    seen = firewall.observe()
    assert lists(commands) == 1
    assert seen.sets.sets["IPVSPROXY-CLUSTER-IP"][2] == {"10.96.0.9,udp:53"}


def test_a_write_beside_someone_else_s_commit_forgets_the_table() -> None:
    commands = FakeCommands(table_json(NodePolicy()))
    firewall = NftFirewall(commands=commands, generation=FakeGeneration(7, 7, 9, 9))  # type: ignore[arg-type]
    firewall.observe()
    firewall.write_sets([SetChange("IPVSPROXY-VIPS", "hash:ip", 4, add=("10.96.0.9",))])
    firewall.observe()
    assert lists(commands) == 2


def test_a_refused_transaction_is_an_error_and_forgets_the_table() -> None:
    commands = FakeCommands(table_json(NodePolicy()), refuse="10.96.0.9")
    firewall = NftFirewall(commands=commands, generation=FakeGeneration(7))  # type: ignore[arg-type]
    firewall.observe()
    with pytest.raises(KernelError, match="File exists"):
        firewall.write_sets([SetChange("IPVSPROXY-VIPS", "hash:ip", 4, add=("10.96.0.9",))])
    firewall.observe()
    assert lists(commands) == 2


def test_diff_shows_the_nft_commands_of_the_transaction() -> None:
    firewall = NftFirewall(commands=FakeCommands(None))  # type: ignore[arg-type]
    wanted = {
        **empty_wanted().sets,
        "IPVSPROXY-CLUSTER-IP": ("hash:ip,port", 4, frozenset({"10.96.0.1,tcp:443"})),
    }
    described = firewall.plan(SetState(wanted)).describe()
    assert ("+", "nft add element inet ipvsproxy cluster-ip { 10.96.0.1 . tcp . 443 }") in described
    assert ("+", "nft add set inet ipvsproxy lb-source") in described
    chains = [c for sign, c in described if c.startswith("nft add chain")]
    assert len(chains) == 5
    assert chains[0].startswith("nft add chain inet ipvsproxy nat-prerouting { type nat hook")


def test_after_its_first_write_alone_the_whole_table_is_known_without_reading_it() -> None:
    commands = FakeCommands(None)  # no table yet
    # observe at 7 (read: none); the write: 7 before, 8 after; then 8 for the next passes
    firewall = NftFirewall(commands=commands, generation=FakeGeneration(7, 7, 8, 8))  # type: ignore[arg-type]
    wanted = SetState(
        {**empty_wanted().sets, "IPVSPROXY-VIPS": ("hash:ip", 4, frozenset({"10.96.0.1"}))}
    )
    firewall.apply(firewall.plan(wanted, firewall.observe()))
    assert not firewall.plan(wanted)  # rules and sets as written: nothing left to do
    assert lists(commands) == 1  # the one reading before the table existed


def test_the_first_services_pass_adds_their_entries_and_the_rules_and_deletes_nothing() -> None:
    """Proxier.plan_first's firewall part: on a table that holds other entries (a node whose
    first sync was cut short), only additions; the full pass that follows does the rest."""
    from ipvsproxy.config import Config
    from ipvsproxy.model import IpvsState, Proto, RealServer, RSKey, VirtualServer, VSKey
    from ipvsproxy.proxier.firewall_step import FirewallStep
    from ipvsproxy.proxier.pass_plan import PassPlan
    from ipvsproxy.sync.desired import Access
    from ipvsproxy.sync.ipvs_pass import IpvsPlan

    sets = {"IPVSPROXY-CLUSTER-IP": [{"concat": ["10.96.5.5", "tcp", 80]}]}
    old = NodePolicy(masquerade_bit=13)  # rules of another setting: rewritten
    firewall = NftFirewall(commands=FakeCommands(table_json(old, sets)))  # type: ignore[arg-type]
    key = VSKey(IPv4Address("10.96.0.1"), 443, Proto.TCP)
    rs = RealServer(RSKey(IPv4Address("192.168.0.1"), 6443))
    state = IpvsState({key: VirtualServer(key)}, {key: {rs.key: rs}}, frozenset({key.address}))
    planned = PassPlan(False, IpvsPlan((), state, IpvsState()), {key: "default/kubernetes:https"})
    step = FirewallStep(firewall, Config(node_name="node-a"), clock=lambda: 0.0)
    access = {key: Access(Frontend.CLUSTER_IP)}
    plan = step.plan_first(planned, access, frozenset(), ()).firewall
    assert plan is not None
    assert not any(change.delete for change in plan.sets)
    assert plan.stale_sets == ()
    added = {(c.name, e) for c in plan.sets for e in c.add}
    assert ("IPVSPROXY-SERVICE-PORTS", "10.96.0.1,tcp:443") in added
    assert ("IPVSPROXY-VIPS", "10.96.0.1") in added
    assert any(line.startswith("flush chain") for line in plan.script)  # the rules, too
