"""What a firewall step would change (`FirewallPlan`) and what it read (`Observed`), the same
values for both implementations of IPVS mode's firewall (iptables + ipset, nftables), and the
set part of a plan (`set_changes()`), computed the same way for both.

Imports: firewall.sets, firewall.ipset (SetChange and the sizing), host.commands, policy,
errors, the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ipvsproxy.errors import KernelError
from ipvsproxy.firewall.ipset import DEFAULT_MAXELEM, SetChange, maxelem_for, too_small
from ipvsproxy.firewall.sets import NFT_NAMES, SetState, nft_element
from ipvsproxy.host.commands import Commands
from ipvsproxy.policy import NodePolicy

__all__ = ["FirewallPlan", "HostFirewall", "Observed", "set_changes"]


@dataclass(frozen=True, slots=True)
class Observed:
    """The host's firewall as one implementation read it: ipvsproxy's sets (spelt as `ipset
    save` prints entries, whichever the implementation) and its rules, in the reading of the
    implementation that made them (iptables: the saved chains per IP version and table;
    nftables: the chains of its table), which only that implementation compares."""

    sets: SetState
    chains: Mapping[Any, Any]  # read and compared only by the implementation that made it


@dataclass(frozen=True, slots=True)
class FirewallPlan:
    sets: tuple[SetChange, ...] = ()
    restores: tuple[tuple[int, str, str], ...] = ()  # iptables: (IP version, table, input)
    stale_sets: tuple[str, ...] = ()  # ipvsproxy's, no longer used: removed after rules
    # nftables: the chain lines of the pass's transaction (`nft -f` syntax), ahead of the
    # element changes `sets` makes; written with them, in one transaction
    script: tuple[str, ...] = ()
    tool: str = "ipset"  # how `describe()` spells the set changes: "ipset" or "nft"

    def __bool__(self) -> bool:
        return bool(self.sets or self.restores or self.stale_sets or self.script)

    def describe(self) -> list[tuple[str, str]]:
        """(sign, command) per change, for `diff`."""
        out: list[tuple[str, str]] = []
        nft = self.tool == "nft"
        for line in self.script:
            sign = "-" if line.startswith(("delete ", "flush ")) else "+"
            out.append((sign, f"nft {line}"))
        for change in self.sets:
            out += _nft_lines(change) if nft else _ipset_lines(change)
        for version, table, payload in self.restores:
            tool = "iptables" if version == 4 else "ip6tables"
            for line in payload.splitlines():
                if line.startswith(":"):
                    out.append(("~", f"{tool} -t {table}: write chain {line[1:].split()[0]}"))
                elif line.startswith(("-I ", "-D ", "-X ")):
                    sign = "+" if line.startswith("-I") else "-"
                    out.append((sign, f"{tool} -t {table} {line}"))
        for name in self.stale_sets:
            out.append(("-", f"nft delete set {TABLE} {NFT_NAMES.get(name, name)}" if nft
                        else f"ipset destroy {name}"))  # fmt: skip
        return out


TABLE = "inet ipvsproxy"  # the nftables implementation's table (nft_firewall.py)


def _ipset_lines(change: SetChange) -> list[tuple[str, str]]:
    """One set's changes as the ipset commands they amount to."""
    out = []
    if change.create:
        out.append(("+", f"ipset create {change.name} {change.kind}"))
    elif change.rebuild:
        out.append(("~", f"ipset rebuild {change.name} maxelem {maxelem_for(len(change.wanted))}"))
    out += [("+", f"ipset add {change.name} {entry}") for entry in change.add]
    out += [("-", f"ipset del {change.name} {entry}") for entry in change.delete]
    return out


def _nft_lines(change: SetChange) -> list[tuple[str, str]]:
    """One set's changes as the nft commands of the transaction, an element a line."""
    name = NFT_NAMES.get(change.name, change.name)
    out = [("+", f"nft add set {TABLE} {name}")] if change.create else []
    out += [("+", f"nft add element {TABLE} {name} {{ {nft_element(e)} }}") for e in change.add]
    out += [("-", f"nft delete element {TABLE} {name} {{ {nft_element(e)} }}")
            for e in change.delete]  # fmt: skip
    return out


def set_changes(
    wanted: SetState, seen: SetState, versions: tuple[int, ...], *, sized: bool = True
) -> tuple[SetChange, ...]:
    """What to change so that the host's sets (`seen`) hold exactly the wanted entries:
    sets created, entries added and deleted, and (`sized`: ipset's sets have a capacity)
    a set too small for what it must hold rebuilt. KernelError: a set of ours exists with
    another type."""
    changes = []
    for name, (kind, version, entries) in sorted(wanted.sets.items()):
        if version not in versions:
            continue
        found = seen.sets.get(name)
        if found is not None and found[0] != kind:
            raise KernelError(f"set {name} exists with type {found[0]}, not {kind}")
        have = found[2] if found is not None else frozenset()
        add, delete = tuple(sorted(entries - have)), tuple(sorted(have - entries))
        small = (
            sized
            and found is not None
            and too_small(seen.maxelem.get(name, DEFAULT_MAXELEM), len(entries))
        )
        if found is None or add or delete or small:
            changes.append(
                SetChange(name, kind, version, found is None, add, delete, entries, rebuild=small)
            )
    return tuple(changes)


class HostFirewall(Protocol):
    """What the pass and the backends ask of either implementation of the firewall
    (host_firewall.Firewall: iptables and ipsets; nft_firewall.NftFirewall: nftables)."""

    name: str  # "iptables" | "nftables"
    options: NodePolicy
    commands: Commands
    versions: tuple[int, ...]

    def check(self) -> None: ...
    def close(self) -> None: ...
    def observe(self) -> Observed: ...
    def observe_sets(self) -> SetState: ...
    def plan(self, wanted: SetState, seen: Observed | None = None) -> FirewallPlan: ...
    def apply(self, plan: FirewallPlan) -> None: ...
    def write_sets(self, changes: Iterable[SetChange]) -> int: ...
    def cleanup(self, *, dry_run: bool = False) -> list[str]: ...
