"""plan(desired, observed) -> the minimal ordered operations that make observed desired (pure).

Order: bind addresses -> add/update services -> add/update destinations -> delete
destinations -> delete services -> unbind addresses. Things are created before use and
removed after nothing uses them. A changed scheduler, flag, timeout or weight is an update
in place (the kernel's SET commands), never delete+add: deleted destinations sit on the
kernel's trash list and re-adding is slow and resets connections. Only owned virtual servers
(see ownership.py) are ever updated or deleted; deleting a service takes its destinations
with it, so those are not deleted one by one.

Imports: model, kernel, sync.ownership.
"""

from __future__ import annotations

from ipvsproxy.kernel import Plan
from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    IpvsState,
    Op,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VSKey,
    addr_order,
)
from ipvsproxy.sync.ownership import Ownership


def plan(
    desired: IpvsState,
    observed: IpvsState,
    *,
    ownership: Ownership,
    manage_addresses: bool = True,
) -> Plan:
    """Operations that turn `observed` into `desired` for everything ipvsproxy owns.

    `manage_addresses=False` leaves the dummy device out (observed state read from a saved
    `ipvsadm-save` file knows nothing of bound addresses).
    """
    bound = observed.bound | desired.bound
    doomed = sorted(
        key
        for key in observed.services
        if key not in desired.services and ownership.claims(key, bound)
    )
    ops: list[Op] = []
    if manage_addresses:
        ops += [BindAddress(a) for a in sorted(desired.bound - observed.bound, key=addr_order)]
    for key in sorted(desired.services):
        vs, seen = desired.services[key], observed.services.get(key)
        if seen is None:
            ops.append(AddService(vs))
        elif seen != vs:
            ops.append(UpdateService(vs))
    for key in sorted(desired.services):
        ops += _dest_changes(key, desired, observed)
    ops += [DeleteService(key) for key in doomed]
    if manage_addresses:
        ops += [UnbindAddress(a) for a in sorted(observed.bound - desired.bound, key=addr_order)]
    return _order(ops)


def _dest_changes(key: VSKey, desired: IpvsState, observed: IpvsState) -> list[Op]:
    want, have = desired.dests[key], observed.dests.get(key, {})
    ops: list[Op] = []
    for rs_key in sorted(want):
        seen = have.get(rs_key)
        if seen is None:
            ops.append(AddDest(key, want[rs_key]))
        elif seen != want[rs_key]:
            ops.append(UpdateDest(key, want[rs_key]))
    ops += [DeleteDest(key, rs_key) for rs_key in sorted(set(have) - set(want))]
    return ops


_PHASE: dict[type, int] = {
    BindAddress: 0,
    AddService: 1,
    UpdateService: 1,
    AddDest: 2,
    UpdateDest: 2,
    DeleteDest: 3,
    DeleteService: 4,
    UnbindAddress: 5,
}


def _order(ops: list[Op]) -> Plan:
    """Phase order, stable within a phase (sorted keys stay sorted)."""
    return tuple(sorted(ops, key=lambda op: _PHASE[type(op)]))
