"""Graceful termination: a removed endpoint drains at weight 0 before it is deleted.

Owns: `Drainer`. Given the desired and the observed table, it finds destinations that are
being removed from a virtual server that stays, and keeps them in the desired state at weight
0 (no new connections) while they still have connections, up to the drain timeout; then lets
the planner delete them; a timeout of 0 waits for the connections without a limit, as
kube-proxy's graceful termination does. UDP and SCTP destinations are deleted at once
(kube-proxy's `IsRsGracefulTerminationNeeded`: a UDP "connection" is only a conntrack entry,
and with `expire_nodest_conn` an SCTP association to a deleted destination is dropped at its
next packet rather than kept half-served). An endpoint that comes back while draining is
simply desired again, so the planner restores its weight.

Restarts: the drain is carried by the kernel table itself. A weight-0 destination that is not
desired is a drain in progress (ipvsproxy never writes weight 0 for anything else that is not
desired), so a restarted agent picks it up, with its clock started anew, and deletes it when
its connections end or the timeout passes: nothing lost, no weight-0 leftovers.

Imports: model, errors, the standard library.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ipvsproxy.errors import KernelError
from ipvsproxy.model import IpvsState, Proto, RealServer, RSKey, VSKey

log = logging.getLogger(__name__)

Connections = Callable[[VSKey], Mapping[RSKey, tuple[int, int]]]


@dataclass(frozen=True, slots=True)
class Held:
    """The desired state with draining destinations added back, and how many drain."""

    state: IpvsState
    draining: int
    released: int  # drains finished in this pass (deleted by the coming plan)


class Drainer:
    def __init__(self, *, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self._started: dict[tuple[VSKey, RSKey], float] = {}

    def keys(self) -> set[VSKey]:
        """The virtual servers with a destination draining (a partial sync must look at
        them: their connection counts decide when each drain ends)."""
        return {vs for vs, _ in self._started}

    def draining(self) -> frozenset[tuple[VSKey, RSKey]]:
        """The destinations draining now, per virtual server (`status`)."""
        return frozenset(self._started)

    def hold(
        self,
        desired: IpvsState,
        observed: IpvsState,
        *,
        connections: Connections,
    ) -> Held:
        now = self._clock()
        leaving = _leaving(desired, observed)
        for gone in self._started.keys() - {(vs, rs.key) for vs, rs in leaving}:
            del self._started[gone]  # restored, or its virtual server went away
        counts: dict[VSKey, Mapping[RSKey, tuple[int, int]] | None] = {}
        kept: dict[VSKey, dict[RSKey, RealServer]] = {}
        released = 0
        for vs, rs in leaving:
            if vs not in counts:
                counts[vs] = _counts(connections, vs)
            start = self._started.setdefault((vs, rs.key), now)
            conns = counts[vs]
            # Unknown counts (the read failed): keep draining, the timeout still bounds it.
            active, inactive = (1, 0) if conns is None else conns.get(rs.key, (0, 0))
            if active + inactive == 0 or 0 < self.timeout <= now - start:
                del self._started[(vs, rs.key)]
                released += 1
                continue
            kept.setdefault(vs, {})[rs.key] = dataclasses.replace(rs, weight=0)
        if not kept:
            return Held(desired, 0, released)
        dests = {
            key: {**desired.dests.get(key, {}), **kept[key]} if key in kept else dests
            for key, dests in desired.dests.items()
        }
        state = IpvsState(desired.services, dests, desired.bound)
        return Held(state, sum(map(len, kept.values())), released)


_NO_DRAIN = frozenset({Proto.UDP, Proto.SCTP})


def _leaving(desired: IpvsState, observed: IpvsState) -> list[tuple[VSKey, RealServer]]:
    """Destinations the plan would delete from virtual servers that stay (not UDP or SCTP
    ones: those go at once).

    A desired virtual server is ipvsproxy's, destinations and all (see sync/plan.py).
    """
    out = []
    seen = observed.dests
    for key, wanted in desired.dests.items():
        have = seen.get(key)
        # the steady state first: one comparison of the two maps
        if not have or have == wanted or key.proto in _NO_DRAIN:
            continue
        if key not in observed.services:
            continue
        out += [(key, rs) for rk, rs in have.items() if rk not in wanted]
    return out


def _counts(connections: Connections, key: VSKey) -> Mapping[RSKey, tuple[int, int]] | None:
    try:
        return connections(key)
    except KernelError as exc:
        log.warning("cannot read connection counts of %s: %s", key, exc)
        return None
