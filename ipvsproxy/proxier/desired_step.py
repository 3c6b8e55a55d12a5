"""The pass's first step: the desired state of this node, kept up to date from the changed
Services the tracker hands over.

Owns `DesiredStep`: the Services translated for this node (`DesiredIndex`), the Node as the
translation sees it (with this host's own addresses), the health-check node ports, which
virtual servers changed since the last pass, and the input's warnings. It reads no kernel
state but this host's addresses.

Imports: sync (translation, the index, the tracker's changes), api, config, model, errors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ipvsproxy.api import NodeView
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError
from ipvsproxy.model import IPAddress, VSKey
from ipvsproxy.sync.desired import (
    Contribution,
    Entry,
    local_ready_endpoints,
    node_warnings,
    translate_service,
)
from ipvsproxy.sync.desired_index import DesiredIndex
from ipvsproxy.sync.tracker import Changes

log = logging.getLogger("ipvsproxy.sync")


@dataclass
class DesiredStep:
    """One node's desired state, fed with the changed Services."""

    config: Config
    # This host's own addresses (netlink/links.py node_addresses), read on the node: they,
    # not the Node object's, are the NodePort addresses and tell a node address from a VIP,
    # as in kube-proxy. None (a saved table, tests): the Node object's addresses.
    node_addresses: Callable[[], tuple[IPAddress, ...]] | None = None
    index: DesiredIndex = field(default_factory=DesiredIndex)
    node: NodeView | None = None
    # per Service ("namespace/name") that wants one, its health-check node port and local
    # ready endpoints (kube-proxy's HealthCheckNodePorts and LocalReadyEndpoints)
    health_checks: dict[str, tuple[int, int]] = field(default_factory=dict)
    changed: set[VSKey] = field(default_factory=set)  # fed since the last pass looked
    known: set[VSKey] = field(default_factory=set)  # wanted by this process, maybe still there
    warnings: tuple[str, ...] = ()  # the input's (Services, Node, conflicts)
    _host: tuple[IPAddress, ...] | None = None

    def refresh_host(self) -> bool:
        """Read this host's addresses again (full passes: an address added or removed is
        followed without a restart); whether they changed, so that every Service must be
        translated again (the caller takes everything from the tracker)."""
        if self.node_addresses is None:
            return False
        try:
            found = self.node_addresses()
        except KernelError as exc:
            log.warning("cannot list this host's addresses (the last ones are kept): %s", exc)
            return False
        if self._host is None:
            self._host = found
            return True
        gained, lost = set(found) - set(self._host), set(self._host) - set(found)
        self._host = found
        if gained or lost:  # the order of a dump is no change
            log.info(
                "this host's addresses changed (gained %s, lost %s): every Service is "
                "translated again",
                ", ".join(map(str, sorted(gained, key=str))) or "none",
                ", ".join(map(str, sorted(lost, key=str))) or "none",
            )
        return bool(gained or lost)

    def feed(self, changes: Changes) -> bool:
        """Translate the changed Services into the desired state; whether the Node (as the
        translation sees it) changed."""
        moved = False
        if changes.everything or self.node is None:
            node = changes.node or NodeView(self.config.node_name)
            if self._host is not None:
                node = replace(node, addresses=self._host)
            if node != self.node:
                self.node, moved = node, True
        assert self.node is not None
        for ref, svc in changes.services.items():
            slices = changes.slices.get(ref, ())
            contribution = (
                translate_service(svc, slices, self.node, self.config) if svc is not None else None
            )
            if svc is not None and svc.health_check_node_port:
                local = local_ready_endpoints(svc, slices, self.config.node_name)
                self.health_checks[svc.ref] = (svc.health_check_node_port, local)
            else:
                self.health_checks.pop("/".join(ref), None)
            if contribution is not None:
                contribution = _reusing(contribution, self.index)
            keys = self.index.update(ref, contribution)
            self.changed |= keys
            self.known |= keys
        self.warnings = (
            *changes.warnings,
            *node_warnings(changes.node, self.config),
            *self.index.warnings(),
        )
        return moved

    def families(self) -> set[int]:
        """The IP versions of the virtual servers this node serves (4 when none)."""
        return {key.address.version for key in self.index.services} or {4}


def _reusing(contribution: Contribution, index: DesiredIndex) -> Contribution:
    """The contribution with the objects the index already holds where they are equal.

    A changed Service is translated whole: one endpoint replaced makes ten new destination
    objects, and the kernel's table (which gets only the one that changed) keeps the nine
    old ones. Without this, desired state and table drift into separate copies of every
    destination touched since start (at 10,000 Services x 10 a soak of 100 changes a second
    grew the heap by a quarter in 3 minutes before every Service had been touched; flat at
    1,000). Equal objects shared, the planner's comparisons also hit the identity fast path."""
    entries: dict[VSKey, Entry] = {}
    shared = False
    for key, entry in contribution.entries.items():
        held, vs = index.dests.get(key), index.services.get(key)
        if held is None or vs is None:
            entries[key] = entry
            continue
        shared = True
        dests = {}
        for rs in entry.dests.values():
            old = held.get(rs.key)
            if old == rs:
                rs = old  # noqa: PLW2901 - the held object, its key and address with it
            dests[rs.key] = rs
        if vs != entry.vs:
            vs = entry.vs
        entries[vs.key] = replace(entry, vs=vs, dests=dests)
    if not shared:  # a new Service (every one in a first sync): nothing held to share
        return contribution
    return replace(contribution, entries=entries)
