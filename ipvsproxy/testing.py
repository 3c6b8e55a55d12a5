"""`FakeKernel`: a strict in-memory Kernel for tests, shipped like kube's ipvs/testing/fake.go.

It fails as the kernel does because it executes `model.transition`, which the contract
suite also checks against the real netlink backend.

Imports: model, kernel, errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ipvsproxy.errors import KernelError
from ipvsproxy.kernel import ApplyReport, Failure, Kernel
from ipvsproxy.model import EMPTY, IpvsState, Op, transition


class FakeKernel:
    """Map-backed kernel; `applied` records successful ops, `errors` injects one-shot failures."""

    def __init__(self, state: IpvsState = EMPTY) -> None:
        self.state = state
        self.applied: list[Op] = []
        self.errors: dict[Op, KernelError] = {}
        self.observations = 0

    def observe(self) -> IpvsState:
        self.observations += 1
        return self.state

    def apply(self, plan: Sequence[Op]) -> ApplyReport:
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
