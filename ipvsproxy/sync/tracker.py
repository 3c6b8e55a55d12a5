"""The latest API objects, parsed once as they arrive, and which Services they touch.

Owns: `Tracker`, a thread-safe store of the newest view per kind and namespaced name, fed by
the watchers (or the manifest source): `replace()` after each list, `event()` per watch event.
Every object is parsed into its frozen view (api.read) the moment it arrives and the raw JSON is
dropped (managedFields, last-applied annotations and every other unused field with it), so a
sync never parses again and memory holds only what ipvsproxy reads. A malformed object is
absent (as if deleted) and its warning is kept until it is fixed or removed.

Each change marks the Services it touches dirty: a Service by its name, an EndpointSlice by
its `kubernetes.io/service-name` label (before and after the change), this node's Node object
all of them (node addresses and names change every Service's translation). The sync thread
calls `take()`: the dirty Services' views and slices, and clears the marks, so a sync
translates only what changed (ipvsproxy/proxier/). `take(everything=True)` hands over all of
them (full resyncs, `diff`).

`synced()` is the guard against a partial view: until every required kind has listed once,
nothing may be programmed, or a restart would delete rules for objects not yet seen.

Imports: api, the standard library.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ipvsproxy.api import (
    NODE,
    SERVICE,
    SLICE,
    TRIGGER_TIME,
    EndpointSliceView,
    NodeView,
    RawJson,
    RawObject,
    Read,
    Ref,
    ServiceView,
    View,
    key_of,
    read,
)

log = logging.getLogger("ipvsproxy.sync")

__all__ = ["NODE", "SERVICE", "SLICE", "TRIGGER_TIME", "Changes", "Tracker"]


@dataclass(frozen=True, slots=True)
class Changes:
    """What a sync needs: the dirty Services (None = gone) with their slices, and the node."""

    services: Mapping[Ref, ServiceView | None]
    slices: Mapping[Ref, tuple[EndpointSliceView, ...]]  # per dirty Service
    node: NodeView | None  # this node's view (None: not listed, or absent)
    everything: bool  # `services` holds every Service (the first take, a node change)
    warnings: tuple[str, ...]  # every malformed object currently in the input
    trigger_times: tuple[str, ...] = ()  # TRIGGER_TIME of slices changed since the last take


class Tracker:
    def __init__(
        self,
        *,
        required: Iterable[str] = (SERVICE, SLICE),
        on_change: Callable[[str], None] = lambda kind: None,
        node_name: str = "",
    ) -> None:
        self._lock = threading.Lock()
        self._required = frozenset(required)
        self._on_change = on_change
        self._node_name = node_name
        self._listed: set[str] = set()
        self._services: dict[Ref, ServiceView] = {}
        self._slices: dict[Ref, EndpointSliceView] = {}
        self._by_service: dict[Ref, dict[Ref, EndpointSliceView]] = {}
        self._nodes: dict[str, NodeView] = {}
        self._warnings: dict[tuple[str, Ref], str] = {}
        self._dirty: set[Ref] = set()
        self._everything = True  # the first take hands over everything
        self._triggers: list[str] = []
        # kube-proxy's *_changes_pending: the Services changed and the slice (and node)
        # changes counted since the last take
        self._pending_services: set[Ref] = set()
        self._pending: dict[str, int] = {}

    # ---- feeding (watcher threads) ----------------------------------------------------------

    def replace(self, kind: str, objects: Iterable[RawObject | RawJson | Read]) -> None:
        """A complete list of `kind` (raw, or already `read()`d): what was not listed is gone."""
        fresh = {}
        for obj in objects:
            item = obj if isinstance(obj, Read) else read(kind, obj)
            fresh[item.key] = item
        with self._lock:
            changed = kind not in self._listed
            self._listed.add(kind)
            for key in self._keys(kind) - fresh.keys():
                changed = self._store(kind, Read(key, None)) or changed
            for item in fresh.values():
                changed = self._store(kind, item, event=True) or changed
        if changed:
            self._on_change(kind)

    def event(self, kind: str, event_type: str, obj: RawObject) -> None:
        """One watch event: ADDED, MODIFIED or DELETED (BOOKMARK and ERROR are not for us)."""
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            return
        item = Read(key_of(obj), None) if event_type == "DELETED" else read(kind, obj)
        with self._lock:
            changed = self._store(kind, item, event=True)
        if changed:
            self._on_change(kind)

    def _keys(self, kind: str) -> set[Ref]:
        if kind == SERVICE:
            return set(self._services)
        if kind == SLICE:
            return set(self._slices)
        return {("", name) for name in self._nodes}

    def _store(self, kind: str, item: Read, *, event: bool = False) -> bool:
        """Store one parsed object (view None: gone or malformed); mark what it touches
        dirty. Whether anything changed."""
        key, view = item.key, item.view
        before = self._warnings.pop((kind, key), "")
        if item.warning:
            self._warnings[(kind, key)] = item.warning
        changed = before != item.warning
        if kind == SERVICE:
            if self._services.get(key) != view:
                self._put(self._services, key, view)
                self._dirty.add(key)
                changed = True
        elif kind == SLICE:
            changed = self._store_slice(key, view) or changed  # type: ignore[arg-type]
            if item.trigger and event:  # a list's old trigger times mean nothing now
                self._triggers.append(item.trigger)
        elif kind == NODE:
            changed = self._store_node(key[1], view) or changed  # type: ignore[arg-type]
        if changed:
            self._count_pending(kind, key)
        return changed

    def _count_pending(self, kind: str, key: Ref) -> None:
        """As kube-proxy counts: Services by name (ServiceChangeTracker's len(items)), slice
        changes one by one (EndpointChangesPending.Inc() per change)."""
        if kind == SERVICE:
            self._pending_services.add(key)
        else:
            self._pending[kind] = self._pending.get(kind, 0) + 1

    def _store_slice(self, key: Ref, view: EndpointSliceView | None) -> bool:
        old = self._slices.get(key)
        if old == view:
            return False
        if old is not None and view is not None:
            view = _sharing(view, old)
        self._put(self._slices, key, view)
        for s in (view, old):  # the new first: an unchanged owner keeps its key objects
            if s is None or not s.service_name:
                continue
            owner = (s.namespace, s.service_name)
            self._dirty.add(owner)
            members = self._by_service.setdefault(owner, {})
            if s is view:
                members[key] = s
            elif members.get(key) is s:
                del members[key]
            if not members:
                del self._by_service[owner]
        return True

    def _store_node(self, name: str, view: NodeView | None) -> bool:
        """This node's Node changes every Service's translation (its addresses, zone, pod
        CIDRs), unless only its eligibility changed, which the health check reads alone."""
        old = self._nodes.get(name)
        if old == view:
            return False
        if view is None:
            del self._nodes[name]
        else:
            self._nodes[name] = view
        ours = not self._node_name or name == self._node_name
        if ours and _translated(old) != _translated(view):
            self._everything = True
            if old is not None:
                log.info("Node %s changed: every Service is translated again", name)
        return True

    @staticmethod
    def _put(store: dict[Ref, Any], key: Ref, view: object) -> None:
        if view is None:
            store.pop(key, None)
        else:
            store[key] = view

    # ---- reading (the sync thread) -------------------------------------------------------------

    def synced(self) -> bool:
        with self._lock:
            return self._required <= self._listed

    def unlisted(self) -> frozenset[str]:
        """The required kinds whose first list has not arrived yet."""
        with self._lock:
            return frozenset(self._required - self._listed)

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts = {SERVICE: len(self._services), SLICE: len(self._slices)}
            if NODE in self._listed:
                counts[NODE] = len(self._nodes)
            return {kind: n for kind, n in counts.items() if kind in self._listed}

    def take(self, *, everything: bool = False) -> Changes:
        """The dirty Services (all of them after a node change, or when asked) and their
        slices; clears the marks."""
        with self._lock:
            everything = everything or self._everything
            refs = self._dirty | self._services.keys() if everything else self._dirty
            services = {ref: self._services.get(ref) for ref in refs}
            slices = {
                ref: tuple(self._by_service.get(ref, {}).values())
                for ref, svc in services.items()
                if svc is not None
            }
            triggers, self._triggers = tuple(self._triggers), []
            self._dirty, self._everything = set(), False
            self._pending, self._pending_services = {}, set()
            return Changes(
                services=services,
                slices=slices,
                node=self._nodes.get(self._node_name) if self._node_name else None,
                everything=everything,
                warnings=tuple(self._warnings.values()),
                trigger_times=triggers,
            )

    def pending(self) -> dict[str, int]:
        """Changes no sync has taken yet, as kube-proxy's *_changes_pending count them:
        `Service`: Services changed; `EndpointSlice` (and `Node`): changes. O(1), read at
        every scrape."""
        with self._lock:
            return {
                SERVICE: len(self._pending_services),
                SLICE: self._pending.get(SLICE, 0),
                **({NODE: self._pending[NODE]} if NODE in self._pending else {}),
            }

    def changed(self) -> frozenset[Ref]:
        """The Services changed since the last `take()`: what the next pass translates again
        (every one before the first); from any thread."""
        with self._lock:
            if self._everything:
                return frozenset(self._services.keys() | self._dirty)
            return frozenset(self._dirty)

    def views(self, kind: str) -> tuple[View, ...]:
        """Every current view of one kind (tests, tools)."""
        with self._lock:
            if kind == SERVICE:
                return tuple(self._services.values())
            if kind == SLICE:
                return tuple(self._slices.values())
            return tuple(self._nodes.values())


def _translated(node: NodeView | None) -> NodeView | None:
    """What of a Node the translation reads (all but its eligibility for /healthz)."""
    return None if node is None else replace(node, eligible=True)


def _sharing(view: EndpointSliceView, old: EndpointSliceView) -> EndpointSliceView:
    """The new version of a slice with the old version's endpoint objects where they are
    equal: a rollout step changes one endpoint of many, and the others (their addresses
    also held by the desired and the kernel's tables) stay one object each, so memory does
    not grow with every slice ever touched (proxier/desired_step.py `_reusing` does the same for the
    destinations)."""
    held = {ep: ep for ep in old.endpoints}
    endpoints = tuple(held.get(ep, ep) for ep in view.endpoints)
    ports = old.ports if old.ports == view.ports else view.ports
    service = old.service_name if old.service_name == view.service_name else view.service_name
    # the same namespace and name (the same key): the old strings, which the tracker's and
    # the proxier's maps already hold as keys
    return replace(
        view,
        namespace=old.namespace,
        name=old.name,
        service_name=service,
        endpoints=endpoints,
        ports=ports,
    )
