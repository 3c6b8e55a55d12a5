"""The desired state of the whole node, kept up to date one Service at a time (pure).

Owns: `DesiredIndex`. Each Service's translation (a `Contribution`, see desired.py) goes in
with `update(ref, contribution)`, which returns the virtual-server keys whose desired entry
may have changed; the index keeps who claims each key (the first Service by namespace/name
wins, as in a from-scratch translation), the winning entries as the desired IPVS table, the
addresses to bind, and this node's endpoint addresses. `state_for(keys, addresses)` is the
desired state restricted to what a partial sync looks at; `desired()` the whole of it.

The tests' translation from scratch (`desired_state()`, tests/factories.py) feeds a fresh
index every Service, so it shares this code with the incremental path; a property test
proves the two equal over random sequences.

Imports: sync.desired (types), model.
"""

from __future__ import annotations

import bisect
from collections.abc import Container, Iterable, Mapping
from types import MappingProxyType
from typing import TypeVar

from ipvsproxy.api import Ref
from ipvsproxy.model import (
    IPAddress,
    IpvsState,
    RealServer,
    RSKey,
    VirtualServer,
    VSKey,
    part_of,
)
from ipvsproxy.sync.desired import Access, Contribution, Desired, Entry, NoLocal

_EMPTY = Contribution()
K = TypeVar("K")


class DesiredIndex:
    def __init__(self) -> None:
        self._contributions: dict[Ref, Contribution] = {}
        self._claims: dict[VSKey, list[Ref]] = {}  # claimants of each key, sorted
        self._winners: dict[VSKey, Entry] = {}
        self.services: dict[VSKey, VirtualServer] = {}
        self.dests: dict[VSKey, Mapping[RSKey, RealServer]] = {}
        # the winners' access and origin, kept as they change: desired() copies them whole
        # (a copy keeps the keys' hashes; a comprehension hashes each key in Python)
        self._access: dict[VSKey, Access] = {}
        self._origins: dict[VSKey, str] = {}
        # the slow-start window of each winner that has one (sync/slowstart.py)
        self.slow_start: dict[VSKey, float] = {}
        self._binders: dict[IPAddress, int] = {}  # winning entries binding each address
        self._local: dict[IPAddress, int] = {}  # Services with an endpoint here at the address
        self._warned: set[Ref] = set()  # contributions with warnings of their own
        self._conflicts: set[VSKey] = set()  # keys claimed by more than one Service
        self.dest_count = 0  # destinations of all desired virtual servers
        self._no_local: dict[NoLocal, int] = {}  # Services whose Local policy fell back
        self.names_version = 0  # bumped when a key's origin ("ns/name:port") comes, goes or changes
        self._published: tuple[int, Mapping[VSKey, str]] = (0, MappingProxyType({}))

    def __len__(self) -> int:
        return len(self.services)

    def update(self, ref: Ref, contribution: Contribution | None) -> set[VSKey]:
        """Replace what Service `ref` asks for (None: it is gone); the keys that may change."""
        old = self._contributions.get(ref, _EMPTY)
        new = contribution or _EMPTY
        self._count(self._local, old.local, -1)
        self._count(self._local, new.local, +1)
        self._count(self._no_local, old.no_local, -1)
        self._count(self._no_local, new.no_local, +1)
        if new.entries or new.local or new.warnings or new.no_local:
            self._contributions[ref] = new  # in place: the map keeps its key objects
        else:
            self._contributions.pop(ref, None)
        if new.warnings:
            self._warned.add(ref)
        else:
            self._warned.discard(ref)
        for key in old.entries.keys() - new.entries.keys():
            claims = self._claims[key]
            del claims[bisect.bisect_left(claims, ref)]
            if not claims:
                del self._claims[key]
        for key in new.entries.keys() - old.entries.keys():
            bisect.insort(self._claims.setdefault(key, []), ref)
        keys = old.entries.keys() | new.entries.keys()
        for key in keys:
            if len(self._claims.get(key, ())) > 1:
                self._conflicts.add(key)
            else:
                self._conflicts.discard(key)
            self._settle(key)
        return keys

    def _settle(self, key: VSKey) -> None:
        """Make the first claimant's entry the desired one for `key`."""
        before = self._winners.pop(key, None)
        self._access.pop(key, None)  # re-inserted last, in the winners' order
        origin = self._origins.pop(key, None)
        self.slow_start.pop(key, None)
        if before is not None:
            self.dest_count -= len(before.dests)
            if before.bind:
                self._count(self._binders, (key.address,), -1)
        claims = self._claims.get(key)
        if not claims:
            self.services.pop(key, None)
            self.dests.pop(key, None)
            self.names_version += origin is not None
            return
        entry = self._contributions[claims[0]].entries[key]
        self.names_version += origin != entry.origin
        self._winners[key] = entry
        self.services[key] = entry.vs
        self.dests[key] = entry.dests
        self._access[key] = entry.access
        self._origins[key] = entry.origin
        if entry.slow_start:
            self.slow_start[key] = entry.slow_start
        self.dest_count += len(entry.dests)
        if entry.bind:
            self._count(self._binders, (key.address,), +1)

    @staticmethod
    def _count(counts: dict[K, int], addresses: Iterable[K], step: int) -> None:
        for address in addresses:
            n = counts.get(address, 0) + step
            if n:
                counts[address] = n
            else:
                del counts[address]

    # ---- reading ------------------------------------------------------------------------------

    def no_local_endpoints(self) -> dict[NoLocal, int]:
        """How many Services' Local traffic policy fell back to the cluster's endpoints,
        per (policy, IP version): kubeproxy_sync_proxy_rules_no_local_endpoints_total."""
        return dict(self._no_local)

    def local_endpoints(self) -> frozenset[IPAddress]:
        return frozenset(self._local)

    @property
    def local(self) -> Container[IPAddress]:
        """This node's endpoint addresses (a live view)."""
        return self._local.keys()

    def access_of(self, keys: Iterable[VSKey]) -> dict[VSKey, Access]:
        return {k: e.access for k in keys if (e := self._winners.get(k)) is not None}

    def state_for(self, keys: Iterable[VSKey], addresses: Iterable[IPAddress]) -> IpvsState:
        """The desired state of these virtual servers and addresses only."""
        return part_of(self.services, self.dests, self._binders, keys, addresses)

    def keys_of(self, refs: Iterable[Ref]) -> set[VSKey]:
        """The desired virtual servers of these Services (those they win)."""
        keys: set[VSKey] = set()
        for ref in refs:
            found = self._contributions.get(ref)
            if found is not None:
                keys.update(k for k in found.entries if self._claims.get(k, [None])[0] == ref)
        return keys

    def names(self, keys: Iterable[VSKey]) -> dict[VSKey, str]:
        return {k: e.origin for k in keys if (e := self._winners.get(k)) is not None}

    def origins(self) -> Mapping[VSKey, str]:
        """Every desired key's origin ("ns/name:port"), as a read-only copy that another
        thread may keep and read while the index changes (the per-Service metrics). Copied
        again only after an origin came, went or changed (a Service or a Service port added
        or removed, a frontend moved), not on endpoint changes; call it from the thread that
        updates the index."""
        version, copy = self._published
        if version != self.names_version:
            copy = MappingProxyType(dict(self._origins))
            self._published = (self.names_version, copy)
        return copy

    def warnings(self) -> tuple[str, ...]:
        """The Services' own warnings, then every key claimed by more than one Service."""
        out = [w for ref in sorted(self._warned) for w in self._contributions[ref].warnings]
        for key in sorted(self._conflicts):
            claims, owner = self._claims[key], self._winners[key].origin
            out += [
                f"Service {self._contributions[ref].entries[key].origin}: {key} is already "
                f"used by {owner}"
                for ref in claims[1:]
            ]
        return tuple(out)

    def desired(self) -> Desired:
        """The whole desired state (copies: safe to keep while the index changes)."""
        state = IpvsState(dict(self.services), dict(self.dests), frozenset(self._binders))
        return Desired(
            state,
            dict(self._origins),
            self.warnings(),
            dict(self._access),
            self.local_endpoints(),
            self.no_local_endpoints(),
        )
