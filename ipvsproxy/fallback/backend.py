"""The iptables fallback backend: the `Kernel` interface over `iptables-save`/`-restore`.

Owns: `IptablesKernel` (the tools run through iptables/tools.py; host.commands' `Commands`
with a prefix such as `ip netns exec NS` runs them in another network namespace). `observe()`
(the periodic full resync) reads the nat table of each family with `iptables-save`, decodes
ipvsproxy's chains only and checks them for damage; `apply()` works from what it last wrote or
read (a `Table`), with no `iptables-save`: it checks each operation with the same kernel
semantics as every backend (`model.transition`), re-renders only the virtual servers the plan
touched, and writes only the chains that differ in one `iptables-restore --noflush` transaction
per family that has any: atomic, so when the tool refuses it, every operation of that family
fails together (and the next apply reads the tables again). A damaged chain (a rule deleted or
added behind our back) is found by the next observe() and rewritten by the apply after it, even
an empty one (see `damage()`).

There are no connection counters here: `connections()` says every destination is idle, so
a removed endpoint goes at once (conntrack keeps established connections flowing to it).

Imports: fallback.*, iptables.*, host.commands, kernel, model, policy, schedulers, errors, the
standard library.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from ipvsproxy.errors import KernelError, KernelUnavailable, Unsupported
from ipvsproxy.fallback.chain_reader import read_state
from ipvsproxy.fallback.chain_table import Table
from ipvsproxy.fallback.chains import (
    FILTER_JUMPS,
    JUMPS,
    filter_ruleset,
    owned,
    owned_filter,
    sanitise,
)
from ipvsproxy.host.commands import Commands
from ipvsproxy.iptables.generation import RulesetGeneration, SavedAt, nf_tables
from ipvsproxy.iptables.parse import Saved, parse_save
from ipvsproxy.iptables.tools import TOOLS, restore
from ipvsproxy.iptables.transaction import (
    Ruleset,
    blocked,
    conflicts,
    damage,
    patch,
    removal,
    transaction,
)
from ipvsproxy.kernel import AccessMap, ApplyReport, Failure
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    Forward,
    IpvsState,
    Op,
    RSKey,
    Traffic,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VSKey,
)
from ipvsproxy.policy import DEFAULT_NODE, NodePolicy
from ipvsproxy.schedulers import IPTABLES_FIDELITY, IptablesFidelity

log = logging.getLogger(__name__)


class IptablesKernel:
    """ipvsproxy's virtual servers as DNAT rules in its own nat chains, masqueraded and
    firewalled as the node's policy says (ipvsproxy/policy.py)."""

    owns_table = True  # its chains hold only what ipvsproxy made: they are the record

    def __init__(
        self, *, commands: Commands | None = None, node: NodePolicy = DEFAULT_NODE
    ) -> None:
        """`node`: the node's NAT settings. Each virtual server's access (frontend, traffic
        policy, loadBalancerSourceRanges) comes with `observe()` and `apply()`; until it
        has, a virtual server is taken for a ClusterIP when its address is a VIP, else for a
        NodePort."""
        self.node = node
        self._commands = commands or Commands()
        self._families: tuple[int, ...] = (4, 6)
        self._table: Table | None = None  # None: unknown, observe before the next apply
        self._repair: dict[int, Saved] = {}  # damaged families, as observed
        self._damage: tuple[str, ...] = ()
        self._warned: set[str] = set()
        self._conflicts: dict[int, str] = {}  # per family, the conflict last warned about
        # per family, the filter-table restore that makes IPVSPX-FORWARD and its jump right
        # ("" = they are); None until an observe() read the filter table
        self._forward: dict[int, str] | None = None
        # {(version, table): save text} of the last saves, with the generation read before
        # them, when the tools are iptables-nft and run in this namespace (no prefix)
        self._saved_at: SavedAt[dict[tuple[int, str], str]] = SavedAt()

    def check(self) -> None:
        """Raise KernelUnavailable unless the IPv4 nat table can be read; IPv6 is optional."""
        try:
            self._save(4)
        except KernelError as exc:
            raise KernelUnavailable(f"iptables cannot be used: {exc}") from exc
        try:
            self._save(6)
        except KernelError as exc:
            log.warning("ip6tables cannot be used, IPv6 Services are not served: %s", exc)
            self._families = (4,)

    # ---- the Kernel interface --------------------------------------------------------------

    def observe(self, *, access: AccessMap | None = None) -> IpvsState:
        """Read both families' nat tables (`iptables-save`), decode ipvsproxy's chains and
        compare them with what that state renders to, with `access`: the periodic full
        resync."""
        texts = self._saves()
        saved = {
            version: parse_save(texts[version, "nat"], owns=owned) for version in self._families
        }
        self._observe_forward(texts)
        last = self._table
        if last is not None and access:  # an access changed without an operation
            last.set_access(access, now=True)
        if last is not None:
            for version, seen in saved.items():
                self._conflict(version, seen, last.ruleset(version))
        if last is not None and not any(
            damage(saved[v], last.ruleset(v), jumps=JUMPS) for v in saved
        ):
            # The chains are exactly what the last state renders to, and rendering reads
            # back exactly (tests/fallback): no need to decode or render them again.
            self._repair, self._damage = {}, ()
            return last.state()
        states = [read_state(s) for s in saved.values()]
        names = {key: name for _, found in states for key, name in found.items()}
        state = IpvsState(
            services={k: v for s, _ in states for k, v in s.services.items()},
            dests={k: v for s, _ in states for k, v in s.dests.items()},
            bound=frozenset(a for s, _ in states for a in s.bound),
        )
        table = Table(state, names, access=access, node=self.node)
        for version in self._families:
            self._conflict(version, saved[version], table.ruleset(version))
        found = {v: damage(saved[v], table.ruleset(v), jumps=JUMPS) for v in self._families}
        self._table = table
        self._repair = {v: saved[v] for v in self._families if found[v]}
        self._damage = tuple(f"IPv{v}: {problem}" for v in self._families for problem in found[v])
        return state

    def damage(self) -> tuple[str, ...]:
        """What the last observe() found wrong in ipvsproxy's own rules that no plan
        expresses (a rule deleted or added behind our back); any apply() repairs it."""
        forward = self._forward or {}
        return self._damage + tuple(
            f"IPv{v}: filter table: IPVSPX-FORWARD or its jump is not as it should be"
            for v in self._families
            if forward.get(v)
        )

    def _saves(self) -> dict[tuple[int, str], str]:
        """`iptables-save` of each family's nat and filter tables, unless nf_tables says no
        rule anywhere changed since the last saves (iptables/generation.py: an idle resync
        then runs no process; the saves were most of an idle resync's cost: docs/performance.md,
        "nf_tables generation check")."""
        generation = None
        if not self._commands.prefix:
            reader = RulesetGeneration.open()
            try:
                generation = reader.current()
            finally:
                reader.close()
        return self._saved_at.read(generation, self._save_all)

    def _save_all(self) -> tuple[dict[tuple[int, str], str], bool]:
        """Each family's nat and filter tables, and whether the tools are iptables-nft."""
        texts = {
            (version, table): self._save(version, table)
            for table in ("nat", "filter")
            for version in self._families
        }
        return texts, all(nf_tables(text) for text in texts.values())

    def _observe_forward(self, texts: dict[tuple[int, str], str] | None = None) -> None:
        """Read each family's filter table: what IPVSPX-FORWARD and its jump need."""
        self._forward = {
            version: transaction(
                parse_save(
                    texts[version, "filter"] if texts else self._save(version, "filter"),
                    table="filter",
                    owns=owned_filter,
                ),
                filter_ruleset(self.node),
                table="filter",
                jumps=FILTER_JUMPS,
            )
            for version in self._families
        }

    def _write_forward(self) -> list[KernelError]:
        """Write what `_observe_forward()` found missing (nothing when the chain is right);
        the restores refused (the pass's caller says so, once)."""
        if self._forward is None:
            self._observe_forward()
        assert self._forward is not None
        refused: list[KernelError] = []
        for version, payload in self._forward.items():
            if payload:
                try:
                    self._restore(version, payload)
                except KernelError as exc:
                    refused.append(exc)
                    continue
                self._forward[version] = ""
        return refused

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        return {}

    def traffic(self) -> Mapping[VSKey, Traffic]:
        return {}  # rule counters are per chain jump, not per connection: none kept

    def apply(
        self,
        plan: Sequence[Op],
        *,
        names: Mapping[VSKey, str] | None = None,
        access: AccessMap | None = None,
    ) -> ApplyReport:
        """Execute `plan` against the chains as last written or observed (no iptables-save
        unless nothing is known yet), and write only the chains it changes: one
        `iptables-restore --noflush` per family that has any, none when nothing changed.
        A family found damaged by the last observe() is rewritten whole instead."""
        if self._table is None:
            self.observe(access=access)
        table = self._table
        assert table is not None
        done: list[Op] = []
        failures: list[Failure] = []
        refused: list[KernelError] = []
        for op in plan:
            try:
                self._supported(op)
                table.step(op)
                done.append(op)
            except KernelError as exc:
                failures.append(Failure(op, exc))
        table.set_access(access or {})
        table.rename(names or {})
        self._warn(done, table.names)
        changes = table.changes()
        for version in self._families:
            whole = version in self._repair
            if whole:
                payload = transaction(self._repair[version], table.ruleset(version), jumps=JUMPS)
            else:
                payload = patch(changes.get(version, {}), jumps=JUMPS)
            try:
                if payload:
                    self._write(version, payload, table, whole=whole)
            except KernelError as exc:
                self._table = None  # unknown now: read again before the next apply
                failed = [op for op in done if _version(op) == version]
                failures += [Failure(op, exc) for op in failed]
                done = [op for op in done if op not in failed]
                refused.append(exc)  # the pass failed: said once, by its caller
        refused += self._write_forward()
        if self._table is not None:
            self._repair, self._damage = {}, ()
        return ApplyReport(len(done), tuple(failures), tuple(refused))

    def _write(self, version: int, payload: str, table: Table, *, whole: bool) -> None:
        """One family's restore. A partial write that deletes a chain and is refused may be
        blocked by someone else's rule jumping into that chain: the family is then read
        again (`iptables-save`, which takes no lock), and if such a rule is there it is
        written whole, what blocks isolated (`transaction.blocked()`: the chain emptied
        and kept), so the rest of the pass still goes in. Any other refusal (a held
        xtables lock: its wait stays bounded) is not retried here. KernelError when the
        tool refuses."""
        try:
            self._restore(version, payload)
        except KernelError:
            if whole or "\n-X " not in payload:
                raise
            saved = parse_save(self._save(version), owns=owned)
            wanted = table.ruleset(version)
            if not blocked(saved, wanted):
                raise
            self._conflict(version, saved, wanted)
            payload = transaction(saved, wanted, jumps=JUMPS)
            if payload:
                self._restore(version, payload)

    def _conflict(self, version: int, saved: Saved, wanted: Ruleset) -> None:
        """Name, in one warning, the chains of ours that rules of others keep alive (once
        per change: not on every pass)."""
        text = conflicts(blocked(saved, wanted))
        if text and self._conflicts.get(version) != text:
            log.warning("IPv%d nat: rules of others jump into ipvsproxy's chains: %s; the "
                        "chains go once those rules do", version, text)  # fmt: skip
        self._conflicts[version] = text

    # ---- beyond the interface ---------------------------------------------------------------

    def cleanup(self, *, dry_run: bool = False) -> list[str]:
        """Remove every chain of ipvsproxy and every jump into them, in both families;
        what was (or, with dry_run, would be) removed, in words."""
        removed: list[str] = []
        for version in self._families:
            saved = parse_save(self._save(version), owns=owned)
            removed += [f"IPv{version} nat: rule -A {c} {spec}" for c, spec in saved.jumps]
            removed += [f"IPv{version} nat: chain {c}" for c in sorted(saved.chains)]
            payload = removal(saved)
            if payload and not dry_run:
                self._restore(version, payload)
            saved = parse_save(self._save(version, "filter"), table="filter", owns=owned_filter)
            removed += [f"IPv{version} filter: rule -A {c} {spec}" for c, spec in saved.jumps]
            removed += [f"IPv{version} filter: chain {c}" for c in sorted(saved.chains)]
            payload = removal(saved, table="filter")
            if payload and not dry_run:
                self._restore(version, payload)
        self._table = None
        self._forward = None
        return removed

    def _save(self, version: int, table: str = "nat") -> str:
        return self._commands.run([TOOLS[version][0], "-t", table])

    def _restore(self, version: int, payload: str) -> None:
        restore(self._commands, version, payload)

    def _supported(self, op: Op) -> None:
        version = _version(op)
        if version not in self._families:
            raise Unsupported(f"IPv{version} is not available to ip6tables here")
        match op:
            case AddService(vs) | UpdateService(vs) if vs.key.fwmark:
                raise Unsupported("firewall-mark services are not supported by iptables")
            case AddDest(key, rs) | UpdateDest(key, rs):
                if rs.key.address.version != key.address.version:
                    raise Unsupported(f"{rs.key} and {key} are of different IP versions")
                if rs.forward is not Forward.MASQ:
                    raise Unsupported(f"forwarding method {rs.forward.name} needs IPVS")
                if rs.upper_threshold or rs.lower_threshold:
                    raise Unsupported("connection thresholds need IPVS")

    def _warn(self, done: list[Op], names: Mapping[VSKey, str]) -> None:
        """Once per Service: its scheduler cannot be imitated, connections spread at random."""
        for op in done:
            if not isinstance(op, (AddService, UpdateService)):
                continue
            scheduler = op.vs.scheduler
            if IPTABLES_FIDELITY[scheduler] is not IptablesFidelity.RANDOM:
                continue
            service = sanitise(names.get(op.vs.key, str(op.vs.key))).rsplit(":", 1)[0]
            if service not in self._warned:
                self._warned.add(service)
                log.warning(
                    "Service %s: scheduler %s is not available on the iptables backend; "
                    "new connections are spread at random (by weight)",
                    service,
                    scheduler,
                )


def _version(op: Op) -> int:
    match op:
        case AddService(vs) | UpdateService(vs):
            return vs.key.address.version
        case DeleteService(key) | AddDest(key, _) | UpdateDest(key, _) | DeleteDest(key, _):
            return key.address.version
        case BindAddress(address) | UnbindAddress(address):
            return address.version
    raise TypeError(f"not an operation: {op!r}")  # pragma: no cover
