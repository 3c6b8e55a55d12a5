"""`FakeKernel`: a strict in-memory Kernel for tests, shipped like kube's ipvs/testing/fake.go.

It fails as the kernel does because it executes `model.transition`, which the contract
suite also checks against the real netlink backend.

Imports: model, kernel, errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ipvsproxy.errors import KernelError, NotFound
from ipvsproxy.kernel import AccessMap, ApplyReport, Failure, Kernel
from ipvsproxy.model import (
    EMPTY,
    Dests,
    DestTraffic,
    IPAddress,
    IpvsState,
    Op,
    RSKey,
    Traffic,
    VirtualServer,
    VSKey,
    execute,
)


class FakeKernel:
    """Map-backed kernel; `applied` records successful ops, `errors` injects one-shot failures.

    Operations change its table in place (`model.execute`), so a plan costs what it touches,
    also with 100,000 destinations; `state` and `observe()` give a snapshot.
    """

    owns_table = False  # as the IPVS table: shared

    def __init__(self, state: IpvsState = EMPTY, *, record: bool = True) -> None:
        self.state = state
        # every operation applied, for tests to assert on; record=False (the benches): none
        # kept, as a kernel keeps none in the agent's memory
        self._record = record
        self.applied: list[Op] = []
        self.errors: dict[Op, KernelError] = {}
        self.observations = 0
        self.traffic_reads = 0  # calls of traffic(): tests check who reads the counters
        self.conns: dict[VSKey, dict[RSKey, tuple[int, int]]] = {}  # set by tests
        self.counters: dict[VSKey, Traffic] = {}  # set by tests (conns above set active/inactive)

    @property
    def state(self) -> IpvsState:
        return IpvsState(dict(self._services), dict(self._dests), frozenset(self._bound))

    @state.setter
    def state(self, state: IpvsState) -> None:
        self._services: dict[VSKey, VirtualServer] = dict(state.services)
        self._dests: dict[VSKey, Dests] = dict(state.dests)
        self._bound: set[IPAddress] = set(state.bound)

    def observe(self, *, access: AccessMap | None = None) -> IpvsState:
        self.observations += 1
        return self.state

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        if key not in self._services:
            raise NotFound(f"no virtual server {key}")
        counts = self.conns.get(key, {})
        return {rs: counts.get(rs, (0, 0)) for rs in self._dests.get(key, {})}

    def traffic(self) -> Mapping[VSKey, Traffic]:
        self.traffic_reads += 1
        out: dict[VSKey, Traffic] = {}
        for key, dests in self._dests.items():
            given = self.counters.get(key, Traffic())
            conns = self.conns.get(key, {})
            found: dict[RSKey, DestTraffic] = {}
            for rs in dests:
                traffic = given.dests.get(rs, DestTraffic())
                if rs in conns:
                    traffic = replace(traffic, active=conns[rs][0], inactive=conns[rs][1])
                found[rs] = traffic
            out[key] = Traffic(given.counters, found)
        return out

    def damage(self) -> tuple[str, ...]:
        return ()

    def apply(
        self,
        plan: Sequence[Op],
        *,
        names: Mapping[VSKey, str] | None = None,
        access: AccessMap | None = None,
    ) -> ApplyReport:
        failures: list[Failure] = []
        applied = 0
        for op in plan:
            try:
                injected = self.errors.pop(op, None)
                if injected is not None:
                    raise injected
                execute(self._services, self._dests, self._bound, op)
            except KernelError as err:
                failures.append(Failure(op, err))
            else:
                if self._record:
                    self.applied.append(op)
                applied += 1
        return ApplyReport(applied=applied, failures=tuple(failures))


if TYPE_CHECKING:
    _conforms: Kernel = FakeKernel()
