"""One sync pass: desired state, observe, hold draining endpoints, plan, apply.

Owns: `sync()` (the level-triggered pass over a `Kernel`) and `SyncResult`. Each pass rebuilds
the whole desired state and diffs it against a fresh observation; with nothing changed the
plan is empty and nothing is written to the kernel.

Imports: sync.desired, sync.drain, sync.ownership, sync.plan, kernel, api, config, model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipvsproxy.api import NodeView
from ipvsproxy.config import Config
from ipvsproxy.kernel import ApplyReport, Kernel, Plan
from ipvsproxy.model import IpvsState
from ipvsproxy.sync.desired import Desired
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.sync.plan import plan


@dataclass(frozen=True, slots=True)
class SyncResult:
    plan: Plan
    report: ApplyReport
    state: IpvsState  # what was asked of the kernel (desired plus draining destinations)
    draining: int = 0
    released: int = 0


def sync(
    kernel: Kernel,
    desired: Desired,
    node: NodeView,
    config: Config,
    *,
    drainer: Drainer | None = None,
) -> SyncResult:
    """One level-triggered pass: observe, plan against the desired state, apply."""
    observed = kernel.observe()
    state, draining, released = desired.state, 0, 0
    if drainer is not None:
        held = drainer.hold(desired.state, observed, connections=kernel.connections)
        state, draining, released = held.state, held.draining, held.released
    ops = plan(state, observed, ownership=ownership_for(config, node.addresses))
    report = kernel.apply(ops, names=desired.origins) if ops or kernel.damage() else ApplyReport()
    return SyncResult(ops, report, state, draining, released)
