"""The firewall rules and ipsets on the live host: observe, plan, apply, clean up.

Owns: `Firewall` (reads ipvsproxy's sets over netlink with a `SetReader`, else by name:
`ipset list -n`, then one `ipset restore` of `save NAME` lines for ipvsproxy's own (exact names)
only, never other agents' sets; its chains with
`iptables-save`; writes set changes over netlink with a `SetWriter`, else as one
`ipset restore` batch and chain changes as one
`iptables-restore --noflush` transaction per family and table), `plan_firewall()` (pure:
observed vs wanted -> `FirewallPlan`, with its description for `diff`), and
`Firewall.write_sets()`, the incremental path's only host access: one `ipset restore` of
changes a `SetIndex` computed, without observing anything.

Why the ipset tool and not pyroute2: pyroute2's IPSet sends one netlink request per entry (and its
API for `ip,port` entries with a protocol is awkward); `ipset restore` sends the whole batch from C,
about two orders of magnitude faster per entry. Sets are filled before the rules that match them are
written; a set with many changes is rebuilt as a temporary set and swapped in atomically, so no
packet ever sees it half-filled. `cleanup` removes the rules before the sets they reference.

Imports: firewall.sets, firewall.ipset, firewall.set_reader, firewall.set_writer,
firewall.rules, iptables (its generation cache, parser, tools and transaction), host.commands,
errors, the standard library.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ipvsproxy.errors import KernelError, KernelUnavailable
from ipvsproxy.firewall.firewall_plan import FirewallPlan, Observed, set_changes
from ipvsproxy.firewall.ipset import (
    BULK,
    Header,
    SetChange,
    SetCommand,
    destroy_commands,
    ipset_script,
    parse_headers,
    parse_ipset_save,
    parse_names,
    render_script,
    save_script,
    set_commands,
)
from ipvsproxy.firewall.rules import FILTER_JUMPS, NAT_JUMPS, OWNED, Options, render
from ipvsproxy.firewall.set_reader import SetReader
from ipvsproxy.firewall.set_writer import SetWriter
from ipvsproxy.firewall.sets import SetState
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.generation import RulesetGeneration, SavedAt, nf_tables
from ipvsproxy.iptables.parse import Saved, parse_save
from ipvsproxy.iptables.tools import TOOLS, restore
from ipvsproxy.iptables.transaction import removal, transaction

__all__ = [
    "BULK",
    "Firewall",
    "FirewallPlan",
    "Observed",
    "SetChange",
    "ipset_script",
    "parse_ipset_save",
    "plan_firewall",
]
JUMPS = {"nat": NAT_JUMPS, "filter": FILTER_JUMPS}
TABLES = ("nat", "filter")


def plan_firewall(
    wanted: SetState, observed: Observed, options: Options, versions: tuple[int, ...] = (4, 6)
) -> FirewallPlan:
    """What to change so that the host has exactly the wanted sets and rules."""
    changes = set_changes(wanted, observed.sets, versions)
    restores = []
    for version in versions:
        rendered = render(version, options)
        for table in TABLES:
            saved = observed.chains.get((version, table))
            saved = saved if isinstance(saved, Saved) else Saved()
            payload = transaction(saved, rendered[table], table=table, jumps=JUMPS[table])
            if payload:
                restores.append((version, table, payload))
    stale = tuple(sorted(set(observed.sets.sets) - set(wanted.sets)))
    return FirewallPlan(tuple(changes), tuple(restores), stale)


@dataclass
class Firewall:
    """ipvsproxy's firewall sets and rules on this host (IPv6 only where ip6tables works)."""

    options: Options = field(default_factory=Options)
    commands: Commands = field(default_factory=Commands)
    versions: tuple[int, ...] = (4, 6)
    # reads the sets over netlink instead of `ipset save` (made in the namespace `commands`
    # work in): no process, no per-entry /etc/protocols read by the ipset tool
    reader: SetReader | None = None
    # writes the sets over netlink instead of `ipset restore` (the same commands, see
    # set_writer.py): the tool parses each entry with libc lookups that read files
    writer: SetWriter | None = None
    # nf_tables' generation id, read before each save of the chains: unchanged since the
    # last save (and the tools are iptables-nft) -> the chains saved then still hold, and a
    # resync runs no `iptables-save` (see iptables/generation.py). Opened by check() for a
    # firewall with a netlink reader (the agent's, closed by close()), in the namespace the
    # tools run in (never with a `commands.prefix`).
    generation: RulesetGeneration | None = None
    name = "iptables"
    # the chains of the last save, with the generation read before it (iptables-nft only)
    _chains: SavedAt[Mapping[tuple[int, str], Saved]] = field(
        default_factory=SavedAt, init=False, repr=False
    )

    def close(self) -> None:
        """Close the netlink sockets (reader, writer, generation), if any."""
        for sock in (self.reader, self.writer, self.generation):
            if sock is not None:
                sock.close()

    def required_tools(self) -> tuple[str, ...]:
        """The programs the firewall cannot work without: the IPv4 iptables tools (its
        rules go through iptables-save/-restore), and the ipset tool only where the sets
        cannot be read or written over netfilter netlink."""
        tools = TOOLS[4]
        return (*tools, "ipset") if self.reader is None or self.writer is None else tools

    def missing_tools(self) -> tuple[str, ...]:
        """`required_tools()` that are not on PATH."""
        return tuple(tool for tool in self.required_tools() if shutil.which(tool) is None)

    def check(self) -> None:
        """KernelUnavailable naming the missing tool, or when the IPv4 nat table cannot be
        read (or the ipset tool fails, where it is needed); IPv6 left out without ip6tables."""
        missing = self.missing_tools()
        if missing:
            raise KernelUnavailable(f"{', '.join(missing)} not found on PATH")
        if "ipset" in self.required_tools():
            self.commands.run(["ipset", "version"])
        self.commands.run([TOOLS[4][0], "-t", "nat"])
        try:
            self.commands.run([TOOLS[6][0], "-t", "nat"])
        except KernelError:
            self.versions = (4,)
        if self.generation is None and self.reader is not None and not self.commands.prefix:
            self.generation = RulesetGeneration.open()  # with the reader: closed with it

    def observe(self) -> Observed:
        return Observed(self.observe_sets(), self.observe_chains())

    def observe_chains(self) -> Mapping[tuple[int, str], Saved]:
        """ipvsproxy's chains per (IP version, table): `iptables-save` per family and
        table, unless nf_tables says no rule anywhere changed since the last save."""
        generation = self.generation.current() if self.generation is not None else None
        return self._chains.read(generation, self._save_chains)

    def _save_chains(self) -> tuple[Mapping[tuple[int, str], Saved], bool]:
        """ipvsproxy's chains, and whether the tools are iptables-nft."""
        chains, nft = {}, True
        for version in self.versions:
            for table in TABLES:
                text = self.commands.run([TOOLS[version][0], "-t", table])
                nft = nft and nf_tables(text)
                chains[version, table] = parse_save(
                    text, table=table, owns=OWNED[table].__contains__
                )
        return chains, nft

    def observe_sets(self) -> SetState:
        """ipvsproxy's sets only: over netlink with a reader; else their names, then one
        batch of `save NAME` (2 processes)."""
        if self.reader is not None:
            return self.reader.observe()
        names = parse_names(self.commands.run(["ipset", "list", "-n"]))
        if not names:
            return SetState({})
        return parse_ipset_save(self.commands.run(["ipset", "restore"], stdin=save_script(names)))

    def plan(self, wanted: SetState, seen: Observed | None = None) -> FirewallPlan:
        """What to change so that the host has exactly `wanted` and the rules (against
        `seen`, else what the host holds now)."""
        seen = self.observe() if seen is None else seen
        return plan_firewall(wanted, seen, self.options, self.versions)

    def apply(self, plan: FirewallPlan) -> None:
        """Sets first, filled (the rules match them), then rules, then unused sets.
        KernelError."""
        self._write(set_commands(plan.sets))
        for version in sorted({version for version, _, _ in plan.restores}):
            # one process per family: each table's transaction ends with its own COMMIT
            payload = "".join(p for v, _, p in plan.restores if v == version)
            restore(self.commands, version, payload)
        self._write(destroy_commands(plan.stale_sets))

    def _write(self, commands: list[SetCommand]) -> None:
        """Over netlink with a writer, else one `ipset restore -exist`. KernelError."""
        if not commands:
            return
        if self.writer is not None:
            self.writer.write(commands)
        else:
            self.commands.run(["ipset", "restore", "-exist"], stdin=render_script(commands))

    def observe_headers(self) -> dict[str, Header]:
        """ipvsproxy's sets' type, family, maxelem and size, with one `ipset list -t`: a
        cheap drift check between full syncs (`SetIndex.drifted()`), as no entry is printed."""
        return parse_headers(self.commands.run(["ipset", "list", "-t"]))

    def write_sets(self, changes: Iterable[SetChange]) -> int:
        """The incremental path: write `SetIndex.take()`'s changes with ONE `ipset restore`
        and nothing else (no observation; the rules are rewritten by full syncs only).
        Returns the number of entries written; KernelError when ipset refuses the batch
        (then the host is unknown: the caller runs a full sync, which observes and seeds)."""
        changes = tuple(changes)
        self._write(set_commands(changes))
        return sum(len(c.add) + len(c.delete) + c.create for c in changes)

    def cleanup(self, *, dry_run: bool = False) -> list[str]:
        """Remove every firewall chain, jump and set: rules before the sets they match."""
        removed: list[str] = []
        observed = self.observe()
        for (version, table), saved in sorted(observed.chains.items()):
            tool = "iptables" if version == 4 else "ip6tables"
            removed += [f"{tool} -t {table}: rule -A {c} {spec}" for c, spec in saved.jumps]
            removed += [f"{tool} -t {table}: chain {c}" for c in sorted(saved.chains)]
            payload = removal(saved, table=table)
            if payload and not dry_run:
                restore(self.commands, version, payload)
        names = sorted(observed.sets.sets)
        removed += [f"ipset {name}" for name in names]
        if not dry_run:
            self._write(destroy_commands(names))
        return removed
