"""The IPVS part of a sync pass: hold draining endpoints, plan, apply (over any `Kernel`).

Owns: `plan_pass()` (desired and observed state of the keys looked at -> the operations, with
removed endpoints held at weight 0 while they drain), `apply_pass()` and `IpvsResult`. The
proxier (ipvsproxy/proxier.py) calls the two, on the whole table at a full resync and on
the changed virtual servers only in between.

Imports: sync.desired, sync.drain, sync.ownership, sync.plan, kernel, api, config, model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ipvsproxy.kernel import ApplyReport, Kernel, Plan
from ipvsproxy.model import IpvsState, VSKey
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.ownership import Ownership
from ipvsproxy.sync.plan import plan


@dataclass(frozen=True, slots=True)
class IpvsPlan:
    """The IPVS operations of one pass and the states they were planned from."""

    plan: Plan
    state: IpvsState  # what is asked of the kernel (desired plus draining destinations)
    observed: IpvsState
    draining: int = 0
    released: int = 0


@dataclass(frozen=True, slots=True)
class IpvsResult:
    plan: Plan
    report: ApplyReport
    state: IpvsState  # what was asked of the kernel (desired plus draining destinations)
    draining: int = 0
    released: int = 0


def plan_pass(
    kernel: Kernel,
    desired: IpvsState,
    observed: IpvsState,
    *,
    ownership: Ownership,
    drainer: Drainer | None = None,
    manage_addresses: bool = True,
) -> IpvsPlan:
    """Operations turning `observed` into `desired`, removed endpoints drained first."""
    state, draining, released = desired, 0, 0
    if drainer is not None:
        held = drainer.hold(desired, observed, connections=kernel.connections)
        state, draining, released = held.state, held.draining, held.released
    ops = plan(state, observed, ownership=ownership, manage_addresses=manage_addresses)
    return IpvsPlan(ops, state, observed, draining, released)


def apply_pass(
    kernel: Kernel, planned: IpvsPlan, *, names: Mapping[VSKey, str], repair: bool = False
) -> IpvsResult:
    """Apply the plan (an empty one too when `repair`: the backend rewrites damage)."""
    report = kernel.apply(planned.plan, names=names) if planned.plan or repair else ApplyReport()
    return IpvsResult(planned.plan, report, planned.state, planned.draining, planned.released)
