"""IPVS mode's firewall as one nftables table of ipvsproxy's own, `table inet ipvsproxy`,
written in one transaction per pass (`--firewall nftables`; docs/firewall.md).

Owns: `NftFirewall` (the same surface as the iptables firewall, host_firewall.Firewall: check,
observe, plan, apply, write_sets, cleanup), `render_chains()` (the table's chains, pure) and the
translation between the sets' entries as the rest of ipvsproxy spells them (`ipset save`'s
text: sets.py, set_index.py and the records work on that) and nftables' elements.

The same rules as the iptables chains of rules.py, rule for rule; the ipsets become the
table's sets, of concatenated types (`ipv4_addr . inet_proto . inet_service`; LB-SOURCE an
interval set), so the rule count stays constant as Services grow:

  nat-prerouting   nat    prerouting   dstnat (-100)  mark for masquerade (IPVSPROXY-SERVICES)
  nat-output       nat    output       dstnat (-100)  the same for the node's own connections,
                                                      and VIP-sourced ones (IPVSPROXY-OUTPUT)
  nat-postrouting  nat    postrouting  srcnat (100)   hairpin, then marked traffic masqueraded
  filter-input     filter input        filter (0)     source ranges, the VIP port filter
  filter-forward   filter forward      filter (0)     INVALID dropped, marked and established
                                                      flows accepted

The priorities are iptables' own for these tables, so ipvsproxy's rules sit where its
iptables chains did relative to everyone else: after kube-proxy's nftables filter chains
(dstnat - 10) and before firewalld's (filter + 10, dstnat + 10, srcnat + 10); and before
IPVS's own hooks (LOCAL_IN at 98, LOCAL_OUT at -98: NF_IP_PRI_NAT_SRC - 2, NF_IP_PRI_NAT_DST
+ 2), which must see the mark and the filters' verdict first.

Exact ownership: ipvsproxy reads and writes only its table; nobody else's table is ever
listed as ours or changed, and the table's existence is its record of having run here.

One transaction per pass: the sets' element changes and any chain rewritten go to one
`nft -f -`, which the kernel commits atomically (a refused transaction changes nothing). A
chain's rules carry a comment with a digest of the rule, so a later pass tells, from the
comments alone, whether a chain still holds what this version would write (`nft`'s printed
form of a rule varies between its versions; the comments do not).

nf_tables raises one generation counter per network namespace with every committed
transaction (iptables/generation.py): the table read at generation G still holds at G, so
an idle resync reads nothing but the counter; after its own write (G -> G + 1, nobody else
in between) the firewall knows the table without reading it.

nftables is spoken to through libnftables in this process where it can be loaded, else the
`nft` tool (nft_runner.py: the same text, the same JSON; why the library there). Why not the
kernel's netlink API directly: nf_tables' rules are bytecode (expressions, registers, set
lookups), which only libnftables compiles; writing that compiler again is not ipvsproxy's job.

Imports: firewall.sets, firewall.ipset (SetChange, host_after), firewall.firewall_plan,
firewall.nft_runner,
iptables.generation (the counter), host.commands, policy, errors, the standard library.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from ipaddress import ip_network

from ipvsproxy.errors import KernelError, KernelUnavailable
from ipvsproxy.firewall.firewall_plan import TABLE, FirewallPlan, Observed, set_changes
from ipvsproxy.firewall.ipset import PROTOCOL_NUMBERS, SetChange, host_after
from ipvsproxy.firewall.nft_runner import MISSING, Libnftables, NftRunner, NftTool
from ipvsproxy.firewall.sets import (
    CLUSTER_IP,
    EXTERNAL_IP,
    LB_FW,
    LB_SOURCE,
    LOOP_BACK,
    NFT_NAMES,
    NODE_PORT,
    SERVICE_PORTS,
    VIPS,
    SetSpec,
    SetState,
    all_sets,
    nft_element,
)
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.generation import RulesetGeneration
from ipvsproxy.policy import NodePolicy

__all__ = ["TABLE", "Chain", "NftFirewall", "entry_of", "render_chains"]

FAMILY, NAME = TABLE.split()
CHUNK = 2000  # elements per `add element` line of a transaction

# the nftables type of each ipset type's entries, per IP version
_ADDR = {4: "ipv4_addr", 6: "ipv6_addr"}
_TYPES = {
    "hash:ip": "{a}",
    "hash:ip,port": "{a} . inet_proto . inet_service",
    "hash:ip,port,ip": "{a} . inet_proto . inet_service . {a}",
    "hash:ip,port,net": "{a} . inet_proto . inet_service . {a}",
}
_INTERVAL = frozenset({"hash:ip,port,net"})
_PROTOCOL_NAMES = {number: name for name, number in PROTOCOL_NUMBERS.items()}
_BY_NFT = {nft: name for name, nft in NFT_NAMES.items()}
_PRIORITIES = {-100: "dstnat", 0: "filter", 100: "srcnat"}  # nft's names for them
_KINDS = {name: (kind, version) for name, kind, version in all_sets()}


@dataclass(frozen=True, slots=True)
class Chain:
    """One base chain of the table, and its rules as `nft` takes them."""

    name: str
    kind: str  # nat | filter
    hook: str
    priority: int
    rules: tuple[str, ...]

    def declaration(self) -> str:
        # nft's names where it takes them (dstnat: not on the output hook, in nft 1.0.6)
        named = _PRIORITIES.get(self.priority) if self.hook != "output" else None
        priority = named or self.priority
        return (
            f"add chain {TABLE} {self.name} {{ type {self.kind} hook {self.hook} "
            f"priority {priority}; policy accept; }}"
        )


@dataclass(frozen=True, slots=True)
class ChainSeen:
    """A chain of the table as `nft -j list table` shows it: its hook and its rules'
    comments (which carry each rule's digest)."""

    kind: str
    hook: str
    priority: int
    comments: tuple[str, ...]


def _seen(chain: Chain) -> ChainSeen:
    """How a listing of the table shows `chain` once written."""
    return ChainSeen(chain.kind, chain.hook, chain.priority,
                     tuple(_comment_of(rule) for rule in chain.rules))  # fmt: skip


def render_chains(options: NodePolicy, versions: tuple[int, ...] = (4, 6)) -> tuple[Chain, ...]:
    """The table's chains for the node's policy: the rules of rules.render(), in nftables."""
    bit = options.bit
    mark = f"meta mark set meta mark | {bit:#x}"
    prerouting: list[tuple[str, str]] = []
    output: list[tuple[str, str]] = []
    postrouting: list[tuple[str, str]] = []
    lb: list[tuple[str, str]] = []
    ports: list[tuple[str, str]] = []
    rejects: list[tuple[str, str]] = []
    for version in versions:
        af = "ip" if version == 4 else "ip6"

        def dst(spec: SetSpec, version: int = version, af: str = af) -> str:
            return f"{af} daddr . meta l4proto . th dport @{spec.nft_name(version)}"

        v = f"IPv{version}"
        cluster = _outside_or_all(options, version)
        if cluster is not None:
            how = "all ClusterIP traffic" if not cluster else "ClusterIP traffic from outside"
            prerouting.append((f"{dst(CLUSTER_IP)} {cluster}{mark}", f"masquerade {how}, {v}"))
            output.append((f"{dst(CLUSTER_IP)} {mark}", f"masquerade the node's ClusterIP, {v}"))
        if options.vip_source_masquerade(version):
            rule = f"{af} saddr . meta l4proto . th dport @{CLUSTER_IP.nft_name(version)} {mark}"
            output.append((rule, f"masquerade VIP-sourced node traffic, {v}"))
        for chain in (prerouting, output):
            chain.append((f"{dst(EXTERNAL_IP)} {mark}", f"masquerade externalIP and LB, {v}"))
            chain.append((f"{dst(NODE_PORT)} {mark}", f"masquerade NodePort, {v}"))
        source = f"{af} daddr . meta l4proto . th dport . {af} saddr"
        postrouting.append((f"{source} @{LOOP_BACK.nft_name(version)} masquerade", f"hairpin, {v}"))
        lb.append(
            (
                f"{dst(LB_FW)} {source} != @{LB_SOURCE.nft_name(version)} drop",
                f"loadBalancerSourceRanges, {v}",
            )
        )
        ports.append((f"{dst(SERVICE_PORTS)} return", f"a Service port on a VIP, {v}"))
        icmp = "icmp" if version == 4 else "icmpv6"
        rejects.append(
            (
                f"ct state new {af} daddr @{VIPS.nft_name(version)} "
                f"reject with {icmp} port-unreachable",
                f"no Service port on a VIP (kubernetes#72236), {v}",
            )
        )
    postrouting += [
        (f"meta mark & {bit:#x} != {bit:#x} return", "not marked: not masqueraded"),
        (f"meta mark set meta mark & {~bit & 0xFFFFFFFF:#x}", "the mark cleared"),
        ("masquerade fully-random", "marked traffic masqueraded"),
    ]
    forward = [] if options.conntrack_tcp_liberal else [("ct state invalid drop", "INVALID")]
    forward += [
        (f"meta mark & {bit:#x} == {bit:#x} accept", "forwarding rules"),
        ("ct state related,established accept", "forwarding conntrack rule"),
    ]
    return (
        Chain("nat-prerouting", "nat", "prerouting", -100, _commented(prerouting)),
        Chain("nat-output", "nat", "output", -100, _commented(output)),
        Chain("nat-postrouting", "nat", "postrouting", 100, _commented(postrouting)),
        Chain("filter-input", "filter", "input", 0, _commented([*lb, *ports, *rejects])),
        Chain("filter-forward", "filter", "forward", 0, _commented(forward)),
    )


def _outside_or_all(options: NodePolicy, version: int) -> str | None:
    """policy.NodePolicy.cluster_ip_masquerade() in nftables: the match for the ClusterIP
    traffic to masquerade, with a trailing space ("" = all of it), or None."""
    if options.masquerade_all:
        return ""
    pods = options.pods(version)
    if pods is None:
        return None
    net, interface, prefix = pods
    if net is not None:
        return f"{'ip' if version == 4 else 'ip6'} saddr != {net} "
    return f'iifname != "{interface}{"*" if prefix else ""}" '


def _commented(rules: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """Each rule with its comment: what it is for and a digest of the rule itself."""
    return tuple(f'{body} comment "{why} [{_digest(body)}]"' for body, why in rules)


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:8]


def _comment_of(rule: str) -> str:
    return rule.rpartition(' comment "')[2].rstrip('"')


# ---- sets and elements ------------------------------------------------------------------


def set_declaration(name: str) -> str:
    """`add set` of one of ipvsproxy's sets (by its name in sets.py)."""
    kind, version = _KINDS[name]
    shape = _TYPES[kind].format(a=_ADDR[version])
    flags = " flags interval;" if kind in _INTERVAL else ""
    return f"add set {TABLE} {NFT_NAMES[name]} {{ type {shape};{flags} }}"


def entry_of(value: object) -> str:
    """An element of `nft -j` output as the entry `ipset save` would print."""
    if isinstance(value, dict) and "elem" in value:  # an element with options
        value = value["elem"]["val"]
    if isinstance(value, dict) and "concat" in value:
        address, proto, port, *rest = value["concat"]
        name = _PROTOCOL_NAMES.get(proto, proto) if isinstance(proto, int) else proto
        return ",".join((str(address), f"{name}:{port}", *(_single(part) for part in rest)))
    return _single(value)


def _single(value: object) -> str:
    if isinstance(value, dict) and "prefix" in value:
        prefix = value["prefix"]
        net = ip_network(f"{prefix['addr']}/{prefix['len']}", strict=False)
        return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)
    if isinstance(value, dict) and "range" in value:  # not written by ipvsproxy: kept as is
        low, high = value["range"]
        return f"{low}-{high}"
    return str(value)


def element_lines(changes: Iterable[SetChange]) -> list[str]:
    """The transaction lines of these changes: entries added, then deleted."""
    out = []
    for change in changes:
        for verb, entries in (("add", change.add), ("delete", change.delete)):
            for start in range(0, len(entries), CHUNK):
                chunk = ", ".join(nft_element(e) for e in entries[start : start + CHUNK])
                out.append(f"{verb} element {TABLE} {NFT_NAMES[change.name]} {{ {chunk} }}")
    return out


# ---- the table on the host --------------------------------------------------------------


@dataclass
class NftFirewall:
    """ipvsproxy's firewall as the nftables table `inet ipvsproxy` on this host."""

    options: NodePolicy = field(default_factory=NodePolicy)
    commands: Commands = field(default_factory=Commands)
    versions: tuple[int, ...] = (4, 6)  # one inet table: both, always
    # nf_tables' generation counter, opened by check() where the tools run in this thread's
    # network namespace (`commands.here`), in that namespace
    generation: RulesetGeneration | None = None
    # how nftables is spoken to: check() opens libnftables where the tools run in this
    # thread's namespace (`commands.here`; bound to it), else the `nft` tool via `commands`
    runner: NftRunner | None = None
    _known: tuple[int, Observed] | None = field(default=None, init=False, repr=False)

    name = "nftables"

    @property
    def nft(self) -> NftRunner:
        if self.runner is None:
            self.runner = NftTool(self.commands)
        return self.runner

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()
        if self.runner is not None:
            self.runner.close()

    def required_tools(self) -> tuple[str, ...]:
        return () if isinstance(self.runner, Libnftables) else ("nft",)

    def missing_tools(self) -> tuple[str, ...]:
        return tuple(tool for tool in self.required_tools() if shutil.which(tool) is None)

    def check(self) -> None:
        """KernelUnavailable when `nft` is missing or the kernel refuses the table (no
        nf_tables, no NAT for the inet family, no concatenated interval sets): the whole
        table is checked by the kernel in a transaction it does not commit (`nft -c`)."""
        if self.runner is None and self.commands.here:
            self.runner = Libnftables.open()
        missing = self.missing_tools()
        if missing:
            raise KernelUnavailable(f"{', '.join(missing)} not found on PATH")
        skeleton = [f"add table {TABLE}", *(set_declaration(n) for n, _, _ in all_sets())]
        for chain in render_chains(self.options, self.versions):
            skeleton += [chain.declaration(), *(f"add rule {TABLE} {chain.name} {rule}"
                                               for rule in chain.rules)]  # fmt: skip
        try:
            self.nft.run(_script(skeleton), check=True)
        except KernelError as exc:
            raise KernelUnavailable(f"nftables refused ipvsproxy's table: {exc}") from exc
        if self.generation is None and self.commands.here:
            self.generation = RulesetGeneration.open()

    def observe(self) -> Observed:
        """The table's sets and chains: read with `nft -j`, unless nothing was committed
        since the last reading (or this firewall's own last write)."""
        generation = self._generation()
        if self._known is not None and generation is not None and self._known[0] == generation:
            return self._known[1]
        observed = self._read()
        self._known = (generation, observed) if generation is not None else None
        return observed

    def observe_sets(self) -> SetState:
        return self.observe().sets

    def _read(self) -> Observed:
        try:
            text = self.nft.list_json("table", FAMILY, NAME)
        except KernelError as exc:
            if MISSING in str(exc):
                return Observed(SetState({}), {})
            raise
        return parse_table(text)

    def plan(self, wanted: SetState, seen: Observed | None = None) -> FirewallPlan:
        """What one transaction must change so that the table holds exactly `wanted` and
        this version's chains (against `seen`, else the table now)."""
        seen = self.observe() if seen is None else seen
        changes = set_changes(wanted, seen.sets, self.versions, sized=False)
        script: list[str] = []
        rendered = render_chains(self.options, self.versions)
        for chain in rendered:
            have = seen.chains.get(chain.name)
            shape = (chain.kind, chain.hook, chain.priority)
            if isinstance(have, ChainSeen) and (have.kind, have.hook, have.priority) == shape:
                if have == _seen(chain):
                    continue
                script.append(f"flush chain {TABLE} {chain.name}")
            else:
                if have is not None:  # another hook or priority: made again
                    script.append(f"delete chain {TABLE} {chain.name}")
                script.append(chain.declaration())
            script += [f"add rule {TABLE} {chain.name} {rule}" for rule in chain.rules]
        names = {chain.name for chain in rendered}
        script += [f"delete chain {TABLE} {n}" for n in sorted(seen.chains) if n not in names]
        stale = tuple(sorted(set(seen.sets.sets) - set(wanted.sets)))
        return FirewallPlan(changes, stale_sets=stale, script=tuple(script), tool="nft")

    def apply(self, plan: FirewallPlan) -> None:
        """The plan as one transaction. KernelError (then nothing changed)."""
        lines = [f"add table {TABLE}"]
        lines += [set_declaration(c.name) for c in plan.sets if c.create]
        lines += plan.script
        lines += element_lines(plan.sets)
        lines += [f"delete set {TABLE} {NFT_NAMES.get(n, n)}" for n in plan.stale_sets]
        chains = None
        if plan.script:  # the chains are this version's from now on
            rendered = render_chains(self.options, self.versions)
            chains = {chain.name: _seen(chain) for chain in rendered}
        self._commit(lines, plan.sets, plan.stale_sets, chains)

    def write_sets(self, changes: Iterable[SetChange]) -> int:
        """The incremental path: these set changes as one transaction, nothing read.
        Returns the number of entries written; KernelError when nft refuses it (then the
        table is as before, and the caller's next pass observes it)."""
        changes = tuple(changes)
        if not changes:
            return 0
        lines = [f"add table {TABLE}", *(set_declaration(c.name) for c in changes if c.create)]
        self._commit(lines + element_lines(changes), changes, (), None)
        return sum(len(c.add) + len(c.delete) + c.create for c in changes)

    def _commit(
        self,
        lines: list[str],
        changes: tuple[SetChange, ...],
        stale: Iterable[str],
        chains: Mapping[str, ChainSeen] | None,
    ) -> None:
        """One transaction. What is known of the table moves with it when this was the only
        commit since it was known (the generation rose by exactly one): its sets as the
        changes leave them, its chains `chains` (None: unchanged). A node's first pass and
        each change after it so never read the table back."""
        if len(lines) == 1:
            return
        before = self._generation()
        known, self._known = self._known, None
        self.nft.run(_script(lines))
        if known is None or before != known[0]:
            return
        after = self._generation()
        if after is None or before is None or after != before + 1:
            return
        gone = set(stale)
        sets = host_after(known[1].sets, changes)
        kept = {n: v for n, v in sets.sets.items() if n not in gone}
        self._known = (
            after,
            Observed(SetState(kept), known[1].chains if chains is None else chains),
        )

    def _generation(self) -> int | None:
        return self.generation.current() if self.generation is not None else None

    def cleanup(self, *, dry_run: bool = False) -> list[str]:
        """The whole table: its chains and sets with it."""
        seen = self._read()
        if not seen.chains and not seen.sets.sets and not self._exists():
            return []
        removed = [f"nft table {TABLE}"]
        removed += [f"nft table {TABLE}: chain {name}" for name in sorted(seen.chains)]
        removed += [f"nft table {TABLE}: set {NFT_NAMES.get(n, n)}" for n in sorted(seen.sets.sets)]
        if not dry_run:
            self._known = None
            self.nft.run(f"delete table {TABLE}\n")
        return removed

    def _exists(self) -> bool:
        try:
            self.nft.list_json("table", FAMILY, NAME)
        except KernelError:
            return False
        return True


def parse_table(text: str) -> Observed:
    """`nft -j list table inet ipvsproxy` as an observation: ipvsproxy's sets (by their
    names in sets.py; a set it does not know is listed as stale, so that a pass removes it)
    and the chains with their rules' comments."""
    try:
        objects = json.loads(text).get("nftables", [])
    except (ValueError, AttributeError) as exc:
        raise KernelError(f"nft -j list table {TABLE}: not the JSON expected: {exc}") from exc
    sets: dict[str, tuple[str, int, frozenset[str]]] = {}
    chains: dict[str, tuple[str, str, int]] = {}
    comments: dict[str, list[str]] = {}
    for item in objects:
        if "set" in item:
            found = item["set"]
            name = _BY_NFT.get(found.get("name"), "")
            kind, version = _KINDS.get(name, ("", 0))
            if name:
                entries = frozenset(entry_of(e) for e in found.get("elem", ()))
                sets[name] = (kind, version, entries)
            else:  # not one of ours (an older version's): gone with the next plan
                sets[found.get("name", "")] = ("", 0, frozenset())
        elif "chain" in item:
            chain = item["chain"]
            chains[chain["name"]] = (chain.get("type", ""), chain.get("hook", ""),
                                     int(chain.get("prio", 0)))  # fmt: skip
            comments.setdefault(chain["name"], [])
        elif "rule" in item:
            rule = item["rule"]
            comments.setdefault(rule["chain"], []).append(rule.get("comment", ""))
    seen = {
        name: ChainSeen(kind, hook, prio, tuple(comments.get(name, ())))
        for name, (kind, hook, prio) in chains.items()
    }
    return Observed(SetState(sets), seen)


def _script(lines: Iterable[str]) -> str:
    return "".join(line + "\n" for line in lines)
