"""`FakeKernel`: a strict in-memory Kernel for tests, shipped like kube's ipvs/testing/fake.go.

It fails as the kernel does because it executes `model.transition`, which the contract
suite also checks against the real netlink backend.

Imports: model, kernel, errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ipvsproxy.errors import KernelError, NotFound
from ipvsproxy.kernel import ApplyReport, Failure, Kernel
from ipvsproxy.model import EMPTY, IpvsState, Op, RSKey, VSKey, transition


class FakeKernel:
    """Map-backed kernel; `applied` records successful ops, `errors` injects one-shot failures."""

    def __init__(self, state: IpvsState = EMPTY) -> None:
        self.state = state
        self.applied: list[Op] = []
        self.errors: dict[Op, KernelError] = {}
        self.observations = 0
        self.conns: dict[VSKey, dict[RSKey, tuple[int, int]]] = {}  # set by tests

    def observe(self) -> IpvsState:
        self.observations += 1
        return self.state

    def connections(self, key: VSKey) -> Mapping[RSKey, tuple[int, int]]:
        if key not in self.state.services:
            raise NotFound(f"no virtual server {key}")
        counts = self.conns.get(key, {})
        return {rs: counts.get(rs, (0, 0)) for rs in self.state.dests.get(key, {})}

    def damage(self) -> tuple[str, ...]:
        return ()

    def apply(self, plan: Sequence[Op], *, names: Mapping[VSKey, str] | None = None) -> ApplyReport:
        failures: list[Failure] = []
        applied = 0
        for op in plan:
            try:
                injected = self.errors.pop(op, None)
                if injected is not None:
                    raise injected
                self.state = transition(self.state, op)
            except KernelError as err:
                failures.append(Failure(op, err))
            else:
                self.applied.append(op)
                applied += 1
        return ApplyReport(applied=applied, failures=tuple(failures))


if TYPE_CHECKING:
    _conforms: Kernel = FakeKernel()
