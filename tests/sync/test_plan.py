"""The planner: minimal ordered operations, ownership, convergence (with hypothesis)."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

from hypothesis import given, settings

from ipvsproxy.model import (
    AddDest,
    AddService,
    BindAddress,
    DeleteDest,
    DeleteService,
    Forward,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    UnbindAddress,
    UpdateDest,
    UpdateService,
    VirtualServer,
    VSKey,
)
from ipvsproxy.schedulers import Scheduler
from ipvsproxy.sync.ownership import Ownership
from ipvsproxy.sync.plan import plan
from ipvsproxy.testing import FakeKernel
from tests.factories import OWN, state_of
from tests.strategies import foreign_states, merge, restrict, states


def vs(addr="10.96.0.10", port=80, sched=Scheduler.RR) -> VirtualServer:
    return VirtualServer(VSKey(ip_address(addr), port, Proto.TCP), sched)


def rs(addr="10.244.1.1", weight=1, forward=Forward.MASQ) -> RealServer:
    return RealServer(RSKey(ip_address(addr), 8080), weight, forward)


def test_from_empty_adds_services_then_destinations_then_binds():
    """A VIP is bound once what serves it is in: bound earlier, a connection to it would
    meet the node's own stack (refused) instead of the Service."""
    a, b = vs("10.96.0.10"), vs("10.96.0.11")
    desired = state_of({a: [rs("10.244.1.1")], b: []}, frozenset({a.key.address, b.key.address}))
    ops = plan(desired, IpvsState(), ownership=OWN)
    assert ops == (
        AddService(a),
        AddService(b),
        AddDest(a.key, rs("10.244.1.1")),
        BindAddress(a.key.address),
        BindAddress(b.key.address),
    )


def test_changes_are_updates_in_place_and_deletes_come_last():
    a = vs()
    observed = state_of({a: [rs("10.244.1.1"), rs("10.244.1.2")]}, frozenset({a.key.address}))
    a_sh = vs(sched=Scheduler.SH)
    desired = state_of({a_sh: [rs("10.244.1.1", weight=0), rs("10.244.1.3")]}, observed.bound)
    assert plan(desired, observed, ownership=OWN) == (
        UpdateService(a_sh),
        UpdateDest(a.key, rs("10.244.1.1", weight=0)),
        AddDest(a.key, rs("10.244.1.3")),
        DeleteDest(a.key, rs("10.244.1.2").key),
    )


def test_a_wrong_forwarding_method_is_corrected_by_an_update():
    a = vs()
    observed = state_of({a: [rs(forward=Forward.ROUTE)]})
    desired = state_of({a: [rs()]})
    assert plan(desired, observed, ownership=OWN, manage_addresses=False) == (
        UpdateDest(a.key, rs()),
    )


def test_deleting_a_service_does_not_delete_its_destinations_one_by_one():
    a = vs()
    observed = state_of({a: [rs("10.244.1.1"), rs("10.244.1.2")]}, frozenset({a.key.address}))
    assert plan(IpvsState(), observed, ownership=OWN) == (
        DeleteService(a.key),
        UnbindAddress(a.key.address),
    )


def test_foreign_virtual_servers_are_never_touched():
    foreign = vs("192.168.7.100", 443)
    fwmark = VirtualServer(VSKey(ip_address("0.0.0.0"), 0, Proto.TCP, fwmark=7))
    observed = state_of({foreign: [rs("192.168.7.11", forward=Forward.ROUTE)], fwmark: []})
    assert plan(IpvsState(), observed, ownership=OWN) == ()


def test_ownership_by_bound_address_and_by_node_port():
    stale_vip = vs("172.20.0.5", 8080)  # not in the service CIDR, but on our dummy device
    stale_np = vs("192.168.0.10", 30080)
    admin_np = vs("192.168.0.10", 22)  # node address, outside the NodePort range
    observed = state_of(
        {stale_vip: [], stale_np: [], admin_np: []}, frozenset({stale_vip.key.address})
    )
    own = Ownership(nodeport_addresses=frozenset({ip_address("192.168.0.10")}))
    assert plan(IpvsState(), observed, ownership=own, manage_addresses=False) == (
        DeleteService(stale_vip.key),
        DeleteService(stale_np.key),
    )


def test_exclude_cidrs_win_over_everything_else():
    a = vs("10.96.5.5")
    own = Ownership(service_cidrs=OWN.service_cidrs, exclude_cidrs=(ip_network("10.96.5.0/24"),))
    assert plan(IpvsState(), state_of({a: []}), ownership=own) == ()


def test_without_address_management_no_bind_ops():
    a = vs()
    desired = state_of({a: []}, frozenset({a.key.address}))
    assert plan(desired, IpvsState(), ownership=OWN, manage_addresses=False) == (AddService(a),)


@settings(max_examples=300, deadline=None)
@given(desired=states(), observed_owned=states(), foreign=foreign_states())
def test_plan_converges_idempotently_and_leaves_foreign_state_alone(
    desired, observed_owned, foreign
):
    observed = merge(observed_owned, foreign)
    kernel = FakeKernel(observed)
    report = kernel.apply(plan(desired, observed, ownership=OWN))
    assert report.failures == ()
    after = kernel.state
    # exactly the desired owned state ...
    assert restrict(after, lambda k: k not in foreign.services) == desired
    # ... foreign virtual servers and their destinations unchanged ...
    assert restrict(after, lambda k: k in foreign.services).services == foreign.services
    assert {k: after.dests[k] for k in foreign.services} == foreign.dests
    # ... and planning again finds nothing to do.
    assert plan(desired, after, ownership=OWN) == ()


@settings(max_examples=200, deadline=None)
@given(desired=states(), observed=states())
def test_plan_is_minimal(desired, observed):
    ops = plan(desired, observed, ownership=OWN)
    touched = [op for op in ops if isinstance(op, AddService | DeleteService)]
    # a service is either added or deleted, never both (no delete+add for a change)
    keys = [op.vs.key if isinstance(op, AddService) else op.key for op in touched]
    assert len(keys) == len(set(keys))
    # nothing already right is rewritten
    for op in ops:
        if isinstance(op, UpdateService):
            assert observed.services[op.vs.key] != op.vs
        if isinstance(op, UpdateDest):
            assert observed.dests[op.service][op.rs.key] != op.rs
    # the number of ops is bounded by the size of the difference
    changed = sum(
        1
        for k in desired.services.keys() | observed.services.keys()
        if desired.services.get(k) != observed.services.get(k)
    )
    assert sum(isinstance(op, AddService | UpdateService | DeleteService) for op in ops) == changed


@given(state=states(), foreign=foreign_states())
def test_in_sync_plans_nothing(state, foreign):
    assert plan(state, merge(state, foreign), ownership=OWN) == ()
