"""What ipvsproxy's chains hold, kept up to date operation by operation (pure, mutable).

Owns: `Table`, the fallback's memory between two observations: the virtual servers,
destinations, VIPs and names last written (or read), and each virtual server's rendered
`Piece`. `step(op)` checks one operation with the kernel semantics every backend shares
(`model.transition`, applied to the one virtual server concerned, so a step costs the same
in a table of ten or ten thousand) and notes which virtual servers it touched; `changes()`
renders only those again and returns, per family, just the chains that differ. A partial
sync therefore costs what changed, not what exists; `ruleset()` is the whole picture, for
the damage check of a full observation and for its repair. Each virtual server is rendered
with its policy (ipvsproxy/policy.py: the node's, and its access, `set_access()`).

Imports: fallback.chains, iptables.transaction (Ruleset), policy, model, the standard library.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from ipvsproxy.fallback.chains import SERVICES, Piece, fixed, render_service, services_chain
from ipvsproxy.iptables.transaction import Ruleset
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    IPAddress,
    IpvsState,
    Op,
    RealServer,
    RSKey,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VirtualServer,
    VSKey,
    transition,
)
from ipvsproxy.policy import DEFAULT_NODE, AccessLike, NodePolicy, frontend_policy

ChainChanges = dict[str, tuple[str, ...] | None]  # chain -> its rules, or None: delete it


class Table:
    """ipvsproxy's virtual servers as last written, with their rendered chains."""

    def __init__(
        self,
        state: IpvsState,
        names: Mapping[VSKey, str],
        *,
        access: Mapping[VSKey, AccessLike] | None = None,
        node: NodePolicy = DEFAULT_NODE,
    ) -> None:
        self.node = node
        self.access: dict[VSKey, AccessLike] = dict(access or {})
        self.services: dict[VSKey, VirtualServer] = dict(state.services)
        self.dests: dict[VSKey, dict[RSKey, RealServer]] = {
            key: dict(state.dests.get(key, {})) for key in self.services
        }
        self.bound: set[IPAddress] = set(state.bound)
        self.names: dict[VSKey, str] = {k: n for k, n in names.items() if k in self.services}
        self._at: defaultdict[IPAddress, set[VSKey]] = defaultdict(set)
        for key in self.services:
            self._at[key.address].add(key)
        self._pieces: dict[VSKey, Piece] = {key: self._render(key) for key in self.services}
        self._touched: set[VSKey] = set()
        self._vips: set[int] = set()  # families whose VIP list changed

    def step(self, op: Op) -> None:
        """Execute one operation; raises KernelError as the kernel would, changing nothing."""
        match op:
            case BindAddress(address) | UnbindAddress(address):
                sub = IpvsState(bound=frozenset({address} & self.bound))
                if address in transition(sub, op).bound:
                    self.bound.add(address)
                else:
                    self.bound.discard(address)
                self._vips.add(address.version)
                self._touched |= self._at.get(address, set())  # masquerade or not
                return
            case AddService(vs) | UpdateService(vs):
                key = vs.key
            case DeleteService(key) | AddDest(key, _) | UpdateDest(key, _) | DeleteDest(key, _):
                pass
        sub = (
            IpvsState({key: self.services[key]}, {key: self.dests[key]})
            if key in self.services
            else IpvsState()
        )
        after = transition(sub, op)
        if key in after.services:
            self.services[key], self.dests[key] = after.services[key], dict(after.dests[key])
            self._at[key.address].add(key)
        else:
            del self.services[key], self.dests[key]
            self.names.pop(key, None)
            self.access.pop(key, None)
            self._at[key.address].discard(key)
        self._touched.add(key)

    def rename(self, names: Mapping[VSKey, str]) -> None:
        """Remember which Service port each virtual server stands for (rule comments)."""
        for key, name in names.items():
            if key in self.services and self.names.get(key) != name:
                self.names[key] = name
                self._touched.add(key)

    def set_access(self, access: Mapping[VSKey, AccessLike], *, now: bool = False) -> None:
        """Remember each virtual server's access (its frontend, traffic policy and source
        ranges: `policy.frontend_policy()`); a virtual server whose access changed is
        rendered again: by the next `changes()`, or at once with `now` (for a comparison
        with what a full observation read, where nothing is to be written unless it differs)."""
        for key, found in access.items():
            if key not in self.services or self.access.get(key) == found:
                continue
            self.access[key] = found
            if now:
                self._pieces[key] = self._render(key)
            else:
                self._touched.add(key)

    def changes(self) -> dict[int, ChainChanges]:
        """Per family, the chains that differ since the last call, and what they hold now."""
        out: defaultdict[int, ChainChanges] = defaultdict(dict)
        dispatch = set(self._vips)
        for key in self._touched:
            old = self._pieces.pop(key, None)
            new = self._render(key) if key in self.services else None
            if new is not None:
                self._pieces[key] = new
            chains = out[key.address.version]
            for chain in old.chains if old else ():
                if new is None or chain not in new.chains:
                    chains[chain] = None
            for chain, rules in new.chains.items() if new else ():
                if old is None or old.chains.get(chain) != rules:
                    chains[chain] = rules
            if (old and old.dispatch) != (new and new.dispatch):
                dispatch.add(key.address.version)
        for version in dispatch:
            out[version][SERVICES] = self._services_chain(version)
        self._touched, self._vips = set(), set()
        return {version: chains for version, chains in out.items() if chains}

    def ruleset(self, version: int) -> Ruleset:
        """Every chain of one family, as they should be."""
        chains = dict(fixed(self.node))
        for key, piece in self._pieces.items():
            if key.address.version == version:
                chains.update(piece.chains)
        chains[SERVICES] = self._services_chain(version)
        return Ruleset(chains)

    def state(self) -> IpvsState:
        return IpvsState(dict(self.services), dict(self.dests), frozenset(self.bound))

    def _render(self, key: VSKey) -> Piece:
        bound = key.address in self.bound
        return render_service(
            self.services[key],
            self.dests[key].values(),
            self.names.get(key) or str(key),
            bound=bound,
            policy=frontend_policy(self.access.get(key), bound=bound),
            node=self.node,
        )

    def _services_chain(self, version: int) -> tuple[str, ...]:
        pieces = (p for k, p in self._pieces.items() if k.address.version == version)
        return services_chain(pieces, (a for a in self.bound if a.version == version))
