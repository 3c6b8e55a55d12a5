"""Graceful termination with FakeKernel and a fake clock."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

from hypothesis import given, settings
from hypothesis import strategies as st

from ipvsproxy.api import NodeView
from ipvsproxy.config import Config
from ipvsproxy.model import (
    EMPTY,
    AddDest,
    DeleteDest,
    IpvsState,
    Proto,
    RealServer,
    RSKey,
    UpdateDest,
    VirtualServer,
    VSKey,
)
from ipvsproxy.sync.drain import Drainer
from ipvsproxy.sync.ipvs_pass import apply_pass, plan_pass
from ipvsproxy.sync.ownership import ownership_for
from ipvsproxy.testing import FakeKernel
from tests.support import Clock

TCP = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
UDP = VSKey(ip_address("10.96.0.10"), 53, Proto.UDP)
SCTP = VSKey(ip_address("10.96.0.10"), 3868, Proto.SCTP)
A, B, C = (RSKey(ip_address(f"10.244.0.{i}"), 8080) for i in (1, 2, 3))
CONFIG = Config(node_name="node-a", service_cidrs=(ip_network("10.96.0.0/16"),))
NODE = NodeView("node-a")


def table(*dests: RSKey, key: VSKey = TCP, weight: int = 1) -> IpvsState:
    return IpvsState(
        {key: VirtualServer(key)}, {key: {d: RealServer(d, weight=weight) for d in dests}}
    )


def setup(*dests: RSKey, key: VSKey = TCP, timeout: float = 30):
    clock = Clock()
    kernel = FakeKernel()
    kernel.apply([op for op in _ops(table(*dests, key=key))])
    return kernel, Drainer(timeout=timeout, clock=clock), clock


def _ops(state: IpvsState):
    from ipvsproxy.sync.ownership import Ownership
    from ipvsproxy.sync.plan import plan

    return plan(state, EMPTY, ownership=Ownership(), manage_addresses=False)


def step(kernel, drainer, desired: IpvsState):
    """One full pass's IPVS steps, as the proxier takes them: observe, plan, apply."""
    ownership = ownership_for(CONFIG, NODE.addresses)
    planned = plan_pass(kernel, desired, kernel.observe(), ownership=ownership, drainer=drainer)
    return apply_pass(kernel, planned, names={})


def test_removed_endpoint_with_connections_drains_at_weight_0_then_goes():
    kernel, drainer, clock = setup(A, B)
    kernel.conns[TCP] = {B: (1, 0)}
    result = step(kernel, drainer, table(A))
    assert result.plan == (UpdateDest(TCP, RealServer(B, weight=0)),)
    assert result.draining == 1
    clock.now = 10
    assert step(kernel, drainer, table(A)).plan == ()  # still connected: stays at 0
    kernel.conns[TCP] = {B: (0, 0)}
    result = step(kernel, drainer, table(A))
    assert result.plan == (DeleteDest(TCP, B),)
    assert (result.draining, result.released) == (0, 1)
    assert kernel.state.dests[TCP].keys() == {A}


def test_inactive_connections_also_hold_the_drain():
    kernel, drainer, _ = setup(A, B)
    kernel.conns[TCP] = {B: (0, 3)}
    assert step(kernel, drainer, table(A)).draining == 1


def test_drain_timeout_deletes_even_with_connections():
    kernel, drainer, clock = setup(A, B, timeout=30)
    kernel.conns[TCP] = {B: (5, 0)}
    step(kernel, drainer, table(A))
    clock.now = 29.9
    assert step(kernel, drainer, table(A)).plan == ()
    clock.now = 30
    assert step(kernel, drainer, table(A)).plan == (DeleteDest(TCP, B),)


def test_drain_timeout_0_waits_for_the_connections_without_a_limit():
    kernel, drainer, clock = setup(A, B, timeout=0)
    kernel.conns[TCP] = {B: (5, 0)}
    assert step(kernel, drainer, table(A)).draining == 1
    clock.now = 7 * 24 * 3600.0  # a week later: still connected, still draining
    result = step(kernel, drainer, table(A))
    assert (result.plan, result.draining) == ((), 1)
    kernel.conns[TCP] = {B: (0, 0)}
    assert step(kernel, drainer, table(A)).plan == (DeleteDest(TCP, B),)


def test_sctp_endpoint_is_deleted_at_once_even_with_associations():
    kernel, drainer, _ = setup(A, B, key=SCTP)
    kernel.conns[SCTP] = {B: (3, 0)}
    assert step(kernel, drainer, table(A, key=SCTP)).plan == (DeleteDest(SCTP, B),)


def test_idle_endpoint_is_deleted_at_once():
    kernel, drainer, _ = setup(A, B)
    assert step(kernel, drainer, table(A)).plan == (DeleteDest(TCP, B),)


def test_udp_endpoint_is_deleted_at_once_even_with_connections():
    kernel, drainer, _ = setup(A, B, key=UDP)
    kernel.conns[UDP] = {B: (0, 4)}
    assert step(kernel, drainer, table(A, key=UDP)).plan == (DeleteDest(UDP, B),)


def test_endpoint_coming_back_during_drain_is_restored():
    kernel, drainer, clock = setup(A, B)
    kernel.conns[TCP] = {B: (1, 0)}
    step(kernel, drainer, table(A))
    clock.now = 5
    result = step(kernel, drainer, table(A, B))
    assert result.plan == (UpdateDest(TCP, RealServer(B, weight=1)),)
    assert result.draining == 0
    # removed again later: a fresh drain with a fresh clock, not the old one's leftovers
    clock.now = 100
    step(kernel, drainer, table(A))
    clock.now = 120
    assert step(kernel, drainer, table(A)).plan == ()


def test_a_restarted_agent_finishes_the_drain_it_finds_in_the_kernel():
    kernel, drainer, clock = setup(A, B)
    kernel.conns[TCP] = {B: (1, 0)}
    step(kernel, drainer, table(A))
    restarted = Drainer(timeout=30, clock=clock)  # a new process: no memory of the drain
    clock.now = 1000
    assert step(kernel, restarted, table(A)).plan == ()  # connections still there: kept
    kernel.conns[TCP] = {}
    assert step(kernel, restarted, table(A)).plan == (DeleteDest(TCP, B),)


def test_deleted_service_goes_at_once():
    kernel, drainer, _ = setup(A, B)
    kernel.conns[TCP] = {B: (1, 0)}
    result = step(kernel, drainer, EMPTY)
    assert kernel.state.services == {}
    assert result.draining == 0


def test_unreadable_counts_keep_draining():
    kernel, drainer, _ = setup(A, B)

    def broken(key):
        from ipvsproxy.errors import KernelError

        raise KernelError("dump failed")

    kernel.connections = broken
    assert step(kernel, drainer, table(A)).draining == 1


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sets(st.sampled_from([A, B, C])),  # desired endpoints this round
            st.dictionaries(st.sampled_from([A, B, C]), st.integers(0, 2)),  # active conns
            st.floats(0, 20),  # time passing
        ),
        min_size=1,
        max_size=8,
    )
)
def test_property_never_cuts_a_connected_endpoint_early_and_always_finishes(rounds):
    kernel, drainer, clock = setup(A, B, C)
    removed_at: dict[RSKey, float] = {}
    for wanted, active, elapsed in rounds:
        clock.now += elapsed
        kernel.conns[TCP] = {rs: (n, 0) for rs, n in active.items()}
        present = set(kernel.state.dests[TCP])
        result = step(kernel, drainer, table(*wanted))
        for rs in present - wanted:
            removed_at.setdefault(rs, clock.now)
            early = clock.now - removed_at[rs] < 30
            if active.get(rs) and early:  # connected and within the timeout: still there
                assert kernel.state.dests[TCP][rs].weight == 0
        for rs in wanted:
            removed_at.pop(rs, None)
            assert kernel.state.dests[TCP][rs].weight == 1
        assert not any(isinstance(op, AddDest) and op.rs.weight == 0 for op in result.plan)
    # whatever happened: once the timeout has passed, only the wanted endpoints remain
    clock.now += 31
    step(kernel, drainer, table(*rounds[-1][0]))
    assert set(kernel.state.dests[TCP]) == rounds[-1][0]
