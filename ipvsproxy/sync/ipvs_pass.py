"""The IPVS part of a sync pass: ramp new endpoints, hold draining ones, plan, apply (over
any `Kernel`).

Owns: `plan_pass()` (desired and observed state of the keys looked at -> the operations, with
new endpoints at their slow-start step's weight and removed endpoints held at weight 0 while
they drain), `apply_pass()` and `IpvsResult`. The
proxier (ipvsproxy/proxier/) calls the two, on the whole table at a full resync and on
the changed virtual servers only in between.

At debug level (`--v 4`) `apply_pass()` logs one line per operation of any backend (the
IPVS table, or the iptables fallback's rules), naming the Service, the virtual server and
the real server, with the fields of `sync.render.facts()`. Debug off, what that costs is one
`isEnabledFor` per pass (a first sync at 10,000 Services x 10 sends 142,000 operations).

Imports: sync.drain, sync.slowstart, sync.ownership, sync.plan, sync.render, kernel, model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ipvsproxy.kernel import ApplyReport, Kernel, Plan
from ipvsproxy.model import EMPTY, IpvsState, Op, VSKey
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.ownership import Ownership
from ipvsproxy.sync.plan import plan
from ipvsproxy.sync.render import Facts, facts, sentence
from ipvsproxy.sync.slowstart import SlowStart

log = logging.getLogger("ipvsproxy.sync")


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
    names: Mapping[VSKey, str] = field(default_factory=dict)  # the Service port of each key
    observed: IpvsState = EMPTY  # what the plan was made against

    def facts(self, op: Op) -> Facts:
        """The log fields of one of its operations (sync.render.facts)."""
        return facts(op, self.names, self.state.services, self.observed.services)


def plan_pass(
    kernel: Kernel,
    desired: IpvsState,
    observed: IpvsState,
    *,
    ownership: Ownership,
    drainer: Drainer | None = None,
    slow_start: SlowStart | None = None,
    windows: Mapping[VSKey, float] | None = None,
    manage_addresses: bool = True,
) -> IpvsPlan:
    """Operations turning `observed` into `desired`, new endpoints of the virtual servers
    with a slow-start window (`windows`) ramping, removed endpoints drained first."""
    state, draining, released = desired, 0, 0
    if slow_start is not None:
        state = slow_start.hold(desired, observed, windows or {})
    if drainer is not None:
        held = drainer.hold(state, observed, connections=kernel.connections)
        state, draining, released = held.state, held.draining, held.released
    ops = plan(state, observed, ownership=ownership, manage_addresses=manage_addresses)
    return IpvsPlan(ops, state, observed, draining, released)


def apply_pass(
    kernel: Kernel,
    planned: IpvsPlan,
    *,
    names: Mapping[VSKey, str],
    access: Mapping[VSKey, Any] | None = None,
    repair: bool = False,
) -> IpvsResult:
    """Apply the plan (an empty one too when `repair`: the backend rewrites damage; or
    given the `access` of the virtual servers looked at: a backend that renders it rewrites
    those whose access changed without an operation)."""
    report = (
        kernel.apply(planned.plan, names=names, access=access)
        if planned.plan or repair or access
        else ApplyReport()
    )
    result = IpvsResult(
        planned.plan,
        report,
        planned.state,
        planned.draining,
        planned.released,
        names,
        planned.observed,
    )
    if log.isEnabledFor(logging.DEBUG):
        log_operations(result)
    return result


def log_operations(result: IpvsResult) -> None:
    """One debug line per operation; a refused one also says why (`error`)."""
    refused = {failure.op: str(failure.error) for failure in result.report.failures}
    for op in result.plan:
        fields = result.facts(op)
        text = sentence(fields)
        if op in refused:
            fields["error"] = refused[op]
            text += f": failed: {refused[op]}"
        log.debug("%s", text, extra=fields)
