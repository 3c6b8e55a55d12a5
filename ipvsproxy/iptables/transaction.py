"""Saved chains vs the chains wanted -> the damage in words, and one restore transaction (pure).

Owns: `damage()` (where ipvsproxy's chains differ from what they should be: a deleted rule,
a rule someone added, a stray chain, a missing or doubled jump), `transaction()` (the
`iptables-restore --noflush` input that makes them so, touching only what differs: changed
chains are declared, which flushes them, and refilled; stale chains are declared and
deleted after every reference to them is gone; jumps are inserted or de-duplicated one by
one. Chains and rules of anyone else never appear in it: `--noflush` leaves them alone)
and `patch()` (the same for a partial sync: only the chains it is given). `blocked()`: the
chains of ours no longer wanted that someone else's rule still jumps to. Deleting one would
make the kernel refuse the whole transaction (`CHAIN_DEL ... busy`), so it is emptied and
kept instead, and the rest of the transaction goes in; `damage()` does not report it again
while it stays empty; `conflicts()` names it for the caller's warning.

`Ruleset` is what they are given: the chains wanted, chain -> rule lines.

Imports: iptables.parse, the standard library.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from ipvsproxy.iptables.parse import Saved
from ipvsproxy.iptables.parse import target as target_of


@dataclass(frozen=True, slots=True)
class Ruleset:
    """ipvsproxy's chains in one family's nat table: chain -> rule lines (`-A CHAIN ...`)."""

    chains: Mapping[str, tuple[str, ...]]


def damage(saved: Saved, target: Ruleset, *, jumps: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """How the saved chains and jumps differ from `target`, in words ("" = none)."""
    found: list[str] = []
    kept = blocked(saved, target)
    for chain in sorted(set(saved.chains) | set(target.chains)):
        have, want = saved.chains.get(chain), target.chains.get(chain)
        if chain in kept and not have:
            continue  # emptied, kept until the rules of others that jump to it go
        if have is None:
            found.append(f"chain {chain} is missing")
        elif want is None:
            found.append(f"chain {chain} is not ipvsproxy's current state")
        elif have != want:
            extra = len(set(have) - set(want))
            missing = len(set(want) - set(have))
            found.append(
                f"chain {chain} differs ({missing} rules missing, {extra} unexpected"
                + (", order" if not (extra or missing) else "")
                + ")"
            )
    for chain, spec in jumps:
        count = saved.jumps.count((chain, spec))
        if count != 1:
            found.append(f"{count} jumps from {chain} where 1 belongs")
    return tuple(found)


def transaction(
    saved: Saved,
    target: Ruleset,
    *,
    table: str = "nat",
    jumps: tuple[tuple[str, str], ...],
) -> str:
    """The restore input turning `saved` into `target` ("" when they are equal)."""
    changed = {c: rules for c, rules in target.chains.items() if saved.chains.get(c) != rules}
    kept = blocked(saved, target)
    stale = sorted(c for c in saved.chains if c not in target.chains and c not in kept)
    emptied = sorted(c for c in kept if saved.chains.get(c))
    fixes: list[str] = []
    for chain, spec in jumps:
        count = saved.jumps.count((chain, spec))
        if count == 0:
            fixes.append(f"-I {chain} 1 {spec}")
        fixes += [f"-D {chain} {spec}"] * max(0, count - 1)
    if not (changed or stale or fixes or emptied):
        return ""
    lines = _creation([c for c in changed if c not in saved.chains], table=table)
    lines += [f"*{table}"]
    lines += [f":{chain} - [0:0]" for chain in sorted((*stale, *emptied), reverse=True)]
    lines += _load_order(changed)
    lines += fixes
    lines += [f"-X {chain}" for chain in stale]
    lines += ["COMMIT", ""]
    return "\n".join(lines)


def blocked(saved: Saved, target: Ruleset) -> dict[str, tuple[tuple[str, str], ...]]:
    """Our chains that `target` no longer has but a rule of someone else still jumps to
    (chain -> those rules, as (chain, spec)): never deleted, only emptied."""
    found: dict[str, list[tuple[str, str]]] = {}
    for chain, spec in saved.jumps:
        into = target_of(spec)
        if into in saved.chains and into not in target.chains:
            found.setdefault(into, []).append((chain, spec))
    return {chain: tuple(rules) for chain, rules in found.items()}


def conflicts(kept: Mapping[str, tuple[tuple[str, str], ...]]) -> str:
    """One sentence naming each kept chain and the rules of others that keep it ("")."""
    return "; ".join(
        f"{chain} is no longer used but still jumped to by "
        + ", ".join(f"'-A {c} {spec}'" for c, spec in rules)
        + ": emptied and kept"
        for chain, rules in sorted(kept.items())
    )


def patch(
    changes: Mapping[str, tuple[str, ...] | None],
    *,
    table: str = "nat",
    jumps: tuple[tuple[str, str], ...],
) -> str:
    """The restore input for a partial sync: each chain in `changes` refilled with its new
    rules, or deleted (None); nothing else is read or written ("" when there is nothing).
    `jumps` are taken for present, never written."""
    if not changes:
        return ""
    saved = Saved({chain: () for chain, rules in changes.items() if rules is None}, jumps)
    target = Ruleset({chain: rules for chain, rules in changes.items() if rules is not None})
    return transaction(saved, target, table=table, jumps=jumps)


CREATE_BATCH = 500  # chains created per transaction ahead of a large load


def _creation(new: list[str], *, table: str) -> list[str]:
    """Many new chains are first created empty, in an order unrelated to their names, in
    transactions of CREATE_BATCH: iptables-nft 1.8.9 reads back chains created in name
    order (as `_load_order()` would create them) an order of magnitude slower (every
    `iptables-save` of a large ruleset pays it), and each transaction's sorted list of
    names stays short. Not atomic, and harmless: empty chains nothing jumps to yet; if the
    load that follows fails, the next observe() reports them and the apply after deletes
    them. A small change (fewer than CREATE_BATCH // 2 new chains) skips this."""
    if len(new) < CREATE_BATCH // 2:
        return []
    order = sorted(new, key=lambda chain: hashlib.blake2b(chain.encode(), digest_size=8).digest())
    lines: list[str] = []
    for start in range(0, len(order), CREATE_BATCH):
        batch = order[start : start + CREATE_BATCH]
        lines += [f"*{table}", *(f":{chain} - [0:0]" for chain in batch), "COMMIT"]
    return lines


def _load_order(changed: dict[str, tuple[str, ...]]) -> list[str]:
    """Each changed chain declared (which flushes it) and refilled, in an order that is
    cheap for iptables-nft: a chain is written just before the first rule that jumps to
    it, and otherwise in descending name order (see rules.py's docstring: every chain a
    restore names goes into a sorted list, walked from its low end). A jump target is
    always declared before the rule that needs it."""
    lines: list[str] = []
    done: set[str] = set()
    targets = {rule: target_of(rule) for rules in changed.values() for rule in rules}

    def write(chain: str) -> None:
        done.add(chain)
        lines.append(f":{chain} - [0:0]")
        for rule in changed[chain]:
            target = targets[rule]
            if target in changed and target not in done:
                write(target)  # depth <= 3: SERVICES -> SVC -> SEP -> MARK-MASQ
            lines.append(rule)

    referenced = set(targets.values())
    roots = sorted((c for c in changed if c not in referenced), reverse=True)
    for chain in (*roots, *sorted(changed, reverse=True)):
        if chain not in done:
            write(chain)
    return lines


def removal(saved: Saved, *, table: str = "nat") -> str:
    """The restore input removing every chain of ipvsproxy and every jump into them."""
    if not (saved.chains or saved.jumps):
        return ""
    lines = [f"*{table}"]
    lines += [f"-D {chain} {spec}" for chain, spec in saved.jumps]
    lines += [f":{chain} - [0:0]" for chain in sorted(saved.chains)]
    lines += [f"-X {chain}" for chain in sorted(saved.chains)]
    lines += ["COMMIT", ""]
    return "\n".join(lines)
