"""What a pass leaves for readers in other threads: `Snapshot`, taken by `snapshot_of()` at
the end of each completed pass, in the thread that ran it.

A snapshot is a value: nothing in it changes after it is taken (the known table's frozen copy,
the index's published origins, tuples), so `status` reads the latest one without a lock and
without waiting for a pass in progress, and never plans: what the node still lacks is what
the pass could not do (`undone`), not a second plan against live state.

Imports: proxier (ipvs_step, passes), sync (slow start), model, api.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ipvsproxy.api import NodeView
from ipvsproxy.model import IpvsState, Op, RSKey, VSKey
from ipvsproxy.proxier.passes import Proxier
from ipvsproxy.sync.slowstart import Ramp


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One node's proxy state as a completed pass left it."""

    node: NodeView | None
    owners: Mapping[VSKey, str]  # each desired virtual server's winner ("ns/name:port")
    table: IpvsState  # the kernel's table as the pass left it (as this process knows it)
    # what the table still lacks: the operations that failed for each virtual server waiting
    # for a retry, and the binds and unbinds the pass could not do (refused settings are
    # not here: they are served plainer at once)
    undone: tuple[Op, ...]
    ramps: Mapping[tuple[VSKey, RSKey], Ramp]  # slow-start ramps, at the weights asked
    warnings: tuple[str, ...]


def snapshot_of(proxier: Proxier) -> Snapshot:
    """The proxier's state now; call it from the thread that runs its passes, between two.
    Costs a shallow copy of the known table when the pass changed it (a fraction of a
    millisecond at 10,000 Services, after the kernel has the pass's writes), nothing more
    when it did not."""
    ramps = proxier.slow_start.ramps() if proxier.slow_start is not None else ()
    return Snapshot(
        node=proxier.node,
        owners=proxier.index.origins(),
        table=proxier.table.frozen(),
        undone=(*proxier.backoff.undone(), *proxier.ipvs.failed_addresses),
        ramps={(ramp.key, ramp.endpoint): ramp for ramp in ramps},
        warnings=proxier.warnings,
    )
