"""The firewall sets, kept per virtual server between full syncs (no host access).

Owns: `SetIndex`. Between periodic full resyncs the sync proxier knows which virtual servers
changed, and must not observe the host: it gives the index each changed virtual server's
entries (`entries_for()`, the function `wanted()` is built from, so both paths agree by
construction), and `take()` returns only the set changes since the last take or seed, which
`Firewall.write_sets()` writes with one `ipset restore`.

An entry can come from several virtual servers (a VIP with several ports is in VIPS once; an
endpoint behind several Services is in LOOP-BACK once per port), so entries are reference
counted: an entry leaves its set when the last virtual server that wanted it lets it go.

Imports: firewall.sets, firewall.ipset, sync.desired (Access), model, the standard library.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Container, Iterable, Iterator, Mapping
from itertools import chain

from ipvsproxy.firewall.ipset import (
    BULK,
    DEFAULT_MAXELEM,
    Header,
    SetChange,
    maxelem_for,
    too_small,
)
from ipvsproxy.firewall.sets import Entry, SetState, all_sets, entries_for
from ipvsproxy.model import IPAddress, IpvsState, VSKey
from ipvsproxy.policy import FrontendPolicy, frontend_policy
from ipvsproxy.sync.desired import Access


class SetIndex:
    """Reference-counted entries per set, what each virtual server contributes, and what the
    host holds since the last `take()`/`seed()`. Sets of other IP versions than `versions`
    are never written (no ip6tables on the host: no IPv6 firewall)."""

    def __init__(self, *, versions: tuple[int, ...] = (4, 6)) -> None:
        self._kinds = {name: (kind, v) for name, kind, v in all_sets() if v in versions}
        self._by_key: dict[VSKey, frozenset[Entry]] = {}
        self._count: dict[Entry, int] = {}
        self._members: dict[str, set[str]] = defaultdict(set)
        self._before: dict[Entry, bool] = {}  # on the host at the last take? (changed ones)
        self._host: dict[str, int] = {}  # set name -> maxelem, for the sets the host has
        self._seeded: SetState | None = None

    def update(self, key: VSKey, entries: Iterable[Entry]) -> None:
        """Replace what `key` contributes (an empty iterable: the virtual server is gone)."""
        new = frozenset(entries)
        old = self._by_key.pop(key, frozenset())
        if new:
            self._by_key[key] = new
        for entry in old - new:
            count = self._count[entry] - 1
            if count:
                self._count[entry] = count
            else:
                del self._count[entry]
                self._before.setdefault(entry, True)
                self._members[entry[0]].discard(entry[1])
        for entry in new - old:
            count = self._count.get(entry, 0)
            if not count:
                self._before.setdefault(entry, False)
                self._members[entry[0]].add(entry[1])
            self._count[entry] = count + 1

    def keys(self) -> frozenset[VSKey]:
        """The virtual servers that contribute entries now."""
        return frozenset(self._by_key)

    def update_from(
        self,
        keys: Iterable[VSKey],
        state: IpvsState,
        access: Mapping[VSKey, Access],
        *,
        local: Container[IPAddress],
    ) -> None:
        """`update()` each of `keys` from the synced state (gone from it: removed)."""
        for key, made in _made(keys, state, access, local):
            self.update(key, made)

    def reset(
        self, state: IpvsState, access: Mapping[VSKey, Access], *, local: Container[IPAddress]
    ) -> None:
        """Every virtual server from scratch (a full sync): `wanted()` of the same input."""
        if self._by_key:
            gone = [key for key in self._by_key if key not in state.services]
            self.update_from([*gone, *state.services], state, access, local=local)
            return
        # An empty index (a first sync: 7,000 entries at 1000x10): what update() does one
        # entry at a time, counted in bulk.
        made = _made(state.services, state, access, local)
        self._by_key = {key: entries for key, entries in made if entries}
        self._count = dict(Counter(chain.from_iterable(self._by_key.values())))
        members = self._members
        for name, entry in self._count:
            members[name].add(entry)
        self._before = {**dict.fromkeys(self._count, False), **self._before}

    def seed(self, state: SetState) -> None:
        """What the host holds now (after a full sync: its observation, or what it wrote);
        the next `take()` compares the index with it."""
        self._seeded = state
        self._host = {name: state.maxelem.get(name, DEFAULT_MAXELEM) for name in state.sets}
        self._before.clear()

    def wanted(self) -> SetState:
        """The sets as the index wants them (equal to `wanted()` of the same input)."""
        return SetState(
            {
                name: (kind, v, frozenset(self._members.get(name, ())))
                for name, kind, v in all_sets()  # every version's, as wanted() (not stale)
            }
        )

    def drifted(self, headers: Mapping[str, Header]) -> tuple[str, ...]:
        """The sets whose observed headers (`Firewall.observe_headers()`) differ from what
        the index believes the host holds after its last take: missing, another type, size
        or capacity, or a set of ours it does not know (a leftover). Any: run a full pass."""
        if self._seeded is not None:
            return ()  # not taken since the seed: nothing to compare yet
        wrong = [name for name in headers if name not in self._kinds]
        for name, (kind, version) in self._kinds.items():
            count = len(self._members.get(name, ()))
            if headers.get(name) != (kind, version, self._host.get(name, -1), count):
                wrong.append(name)
        return tuple(sorted(wrong))

    def take(self) -> tuple[SetChange, ...]:
        """The changes since the last take/seed: sets to create, entries to add and delete,
        sets too small for what they must hold rebuilt bigger (swapped in). The index then
        assumes they were written."""
        if self._seeded is not None:
            diff = self._diff_from(self._seeded)
        else:
            diff = self._diff_since_take()
        changes = []
        for name, (kind, version) in sorted(self._kinds.items()):
            add, delete = diff.get(name, ((), ()))
            members = self._members.get(name, set())
            create = name not in self._host
            rebuild = not create and too_small(self._host[name], len(members))
            if not (create or rebuild or add or delete):
                continue
            big = create or rebuild or len(add) + len(delete) > BULK
            wanted = frozenset(members) if big else frozenset()
            if create:
                add, delete = tuple(sorted(members)), ()
            changes.append(SetChange(name, kind, version, create, add, delete, wanted, rebuild))
            if create or rebuild:
                self._host[name] = maxelem_for(len(members))
        self._seeded = None
        self._before.clear()
        return tuple(changes)

    def _diff_from(self, seen: SetState) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        diff = {}
        for name in self._kinds:
            members = self._members.get(name, set())
            have = seen.sets[name][2] if name in seen.sets else frozenset()
            diff[name] = (tuple(sorted(members - have)), tuple(sorted(have - members)))
        return diff

    def _diff_since_take(self) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        add: dict[str, list[str]] = defaultdict(list)
        delete: dict[str, list[str]] = defaultdict(list)
        for (name, entry), was in self._before.items():
            now = (name, entry) in self._count
            if now and not was:
                add[name].append(entry)
            elif was and not now:
                delete[name].append(entry)
        return {
            name: (tuple(sorted(add.get(name, ()))), tuple(sorted(delete.get(name, ()))))
            for name in add.keys() | delete.keys()
        }


def _made(
    keys: Iterable[VSKey],
    state: IpvsState,
    access: Mapping[VSKey, Access],
    local: Container[IPAddress],
) -> Iterator[tuple[VSKey, frozenset[Entry]]]:
    """Each key's entries in the synced state (none: gone from it)."""
    # a few distinct policies among many virtual servers: each worked out once
    policies: dict[tuple[Access | None, bool], FrontendPolicy] = {}
    for key in keys:
        if key not in state.services:
            yield key, frozenset()
            continue
        bound = key.address in state.bound
        how = access.get(key), bound
        policy = policies.get(how)
        if policy is None:
            policy = policies[how] = frontend_policy(how[0], bound=bound)
        dests = state.dests.get(key, {})
        yield key, entries_for(key, how[0], dests, local=local, bound=bound, policy=policy)
