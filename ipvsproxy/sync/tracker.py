"""The latest API objects, fed by the watchers (or the manifest source), read by the sync loop.

Owns: `Tracker`, a thread-safe store of the newest raw object per kind and namespaced name.
Watchers call `replace()` after each list and `event()` per watch event; every change calls
`on_change(kind)` (which asks the runner for a sync). The sync thread takes a `snapshot()`.
Events only mark state dirty; the sync rebuilds everything from the snapshot (level-triggered).

`synced()` is the guard against a partial view: until every required kind has listed once,
nothing may be programmed, or a restart would delete rules for objects not yet seen.

Imports: api, the standard library.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ipvsproxy.api import RawObject

SERVICE, SLICE, NODE = "Service", "EndpointSlice", "Node"
API_VERSIONS = {SERVICE: "v1", SLICE: "discovery.k8s.io/v1", NODE: "v1"}

# EndpointSlice annotation set by the endpoint controllers: when the change that produced this
# slice happened (for kubeproxy_network_programming_duration_seconds).
TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"


def _key(obj: RawObject) -> tuple[str, str]:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return ("", "")
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _with_kind(kind: str, obj: RawObject) -> dict[str, Any]:
    """List items carry no kind/apiVersion (see the API's list format): add them back."""
    return {**obj, "kind": kind, "apiVersion": obj.get("apiVersion") or API_VERSIONS[kind]}


@dataclass(frozen=True, slots=True)
class Snapshot:
    objects: tuple[RawObject, ...]
    trigger_times: tuple[str, ...]  # TRIGGER_TIME annotations of slices changed since the last


class Tracker:
    def __init__(
        self,
        *,
        required: Iterable[str] = (SERVICE, SLICE),
        on_change: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
        self._required = frozenset(required)
        self._on_change = on_change
        self._triggers: list[str] = []

    def replace(self, kind: str, objects: Iterable[RawObject]) -> None:
        """A complete list of `kind`: what was not listed is gone."""
        fresh = {_key(obj): _with_kind(kind, obj) for obj in objects}
        with self._lock:
            changed = self._objects.get(kind) != fresh
            self._objects[kind] = fresh
        if changed:
            self._on_change(kind)

    def event(self, kind: str, event_type: str, obj: RawObject) -> None:
        """One watch event: ADDED, MODIFIED or DELETED (BOOKMARK and ERROR are not for us)."""
        key = _key(obj)
        with self._lock:
            store = self._objects.setdefault(kind, {})
            if event_type == "DELETED":
                if store.pop(key, None) is None:
                    return
            elif event_type in ("ADDED", "MODIFIED"):
                store[key] = _with_kind(kind, obj)
                trigger = _annotation(obj, TRIGGER_TIME) if kind == SLICE else None
                if trigger:
                    self._triggers.append(trigger)
            else:
                return
        self._on_change(kind)

    def synced(self) -> bool:
        with self._lock:
            return self._required <= self._objects.keys()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {kind: len(store) for kind, store in self._objects.items()}

    def snapshot(self) -> Snapshot:
        with self._lock:
            objects = tuple(obj for store in self._objects.values() for obj in store.values())
            triggers, self._triggers = tuple(self._triggers), []
        return Snapshot(objects, triggers)


def _annotation(obj: RawObject, name: str) -> str | None:
    meta = obj.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(name) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) else None
