"""plan(desired, observed) -> the minimal ordered operations that make observed desired (pure).

Order: add/update services -> add/update destinations -> bind addresses -> delete
destinations -> delete services -> unbind addresses. Things are created before use and
removed after nothing uses them; a VIP is bound only once what serves it is in place. A
changed scheduler, flag, timeout or weight is an update in place (the kernel's SET
commands), never delete+add: deleted destinations sit on the kernel's trash list and
re-adding is slow and resets connections. Only owned virtual servers
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
    Dests,
    IpvsState,
    Op,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VSKey,
    addr_order,
    rs_order,
    vs_order,
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
    doomed = sorted(  # the keys' difference in C, with the hashes the dicts hold
        (
            key
            for key in observed.services.keys() - desired.services.keys()
            if ownership.claims(key, bound)
        ),
        key=vs_order,
    )
    binds: list[Op] = []
    unbinds: list[Op] = []
    if manage_addresses:
        binds = [BindAddress(a) for a in sorted(desired.bound - observed.bound, key=addr_order)]
        unbinds = [UnbindAddress(a) for a in sorted(observed.bound - desired.bound, key=addr_order)]
    services: list[Op] = []
    upserts: list[Op] = []
    removals: list[Op] = []
    for key in sorted(desired.services, key=vs_order):
        vs, seen = desired.services[key], observed.services.get(key)
        if seen is None:
            services.append(AddService(vs))
        elif seen != vs:
            services.append(UpdateService(vs))
        _dest_changes(key, desired.dests[key], observed.dests.get(key, {}), upserts, removals)
    deletes: list[Op] = [DeleteService(key) for key in doomed]
    # Built phase by phase, so no sort is needed: the order is the contract. A VIP is bound
    # once its virtual servers and their destinations are in: bound earlier, a connection to
    # it would meet the node's own stack (refused) instead of its Service.
    return (*services, *upserts, *binds, *removals, *deletes, *unbinds)


def _dest_changes(
    key: VSKey, want: Dests, have: Dests, upserts: list[Op], removals: list[Op]
) -> None:
    if want == have:  # the steady state: nothing to compare one by one
        return
    if not have:  # a new service: everything is an add, in the desired (translation) order
        upserts += [AddDest(key, rs) for rs in want.values()]
        return
    for rs_key in sorted(want, key=rs_order):
        seen = have.get(rs_key)
        if seen is None:
            upserts.append(AddDest(key, want[rs_key]))
        elif seen != want[rs_key]:
            upserts.append(UpdateDest(key, want[rs_key]))
    extra = have.keys() - want.keys()
    if extra:
        removals += [DeleteDest(key, k) for k in sorted(extra, key=rs_order)]
