"""Refused settings and failed operations: a Service whose scheduler the kernel
lacks is served with the node's default, found out once; other failures are retried for
their virtual server alone, with backoff; neither touches the node's health."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from ipaddress import ip_address
from typing import Any

from ipvsproxy.agent_loop import SAME_ERROR_LINES
from ipvsproxy.backoff import Backoff
from ipvsproxy.config import Config
from ipvsproxy.errors import KernelError, Unsupported
from ipvsproxy.kernel import ApplyReport
from ipvsproxy.model import AddDest, AddService, Op, Proto, UpdateService, VirtualServer, VSKey
from ipvsproxy.proxier import Proxier
from ipvsproxy.schedulers import SCHEDULER_ANNOTATION, Scheduler
from ipvsproxy.sync.failures import Failing
from ipvsproxy.sync.tracker import NODE, SERVICE, SLICE, Tracker
from ipvsproxy.testing import FakeKernel
from tests.factories import ep, node, service, slice_
from tests.support import Clock, driven_agent, next_run, sample

CONFIG = Config(node_name="node-a", min_sync_period=0.0, sync_period=30.0)


class NoTwos(FakeKernel):
    """A kernel without ip_vs_twos (Debian 6.1's): adding or switching a virtual server to
    it fails with ENOENT, as ip_vs_ctl.c answers, which the netlink layer maps to
    Unsupported; nothing of the refused operation is applied."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[Op] = []

    def apply(
        self, plan: Sequence[Op], *, names: Mapping[VSKey, str] | None = None, access: Any = None
    ) -> ApplyReport:
        for op in plan:
            if isinstance(op, AddService | UpdateService) and op.vs.scheduler is Scheduler.TWOS:
                self.errors[op] = Unsupported(f"{op}: ENOENT: scheduler module not available")
        report = super().apply(plan, names=names, access=access)
        self.refused += [f.op for f in report.failures if isinstance(f.error, Unsupported)]
        return report


def twos(name: str, vip: str, scheduler: str = "twos") -> Any:
    return service(name, cluster_ips=(vip,), annotations={SCHEDULER_ANNOTATION: scheduler})


def schedulers(kernel: FakeKernel) -> dict[str, Scheduler]:
    return {str(k.address): vs.scheduler for k, vs in kernel.state.services.items()}


def tracker_with(*objects: Any) -> Tracker:
    tracker = Tracker(required=(SERVICE, SLICE, NODE), node_name="node-a")
    tracker.replace(NODE, [node()])
    for kind in (SERVICE, SLICE):
        tracker.replace(kind, [o for o in objects if o["kind"] == kind])
    return tracker


def test_a_scheduler_the_kernel_lacks_is_replaced_by_the_default_found_out_once():
    kernel = NoTwos()
    tracker = tracker_with(
        twos("a", "10.96.0.1"), slice_("a", endpoints=[ep("10.244.0.1")]), twos("b", "10.96.0.2")
    )
    proxier = Proxier(kernel=kernel, config=CONFIG)
    first = proxier.sync(tracker.take(), full=True)
    assert len(kernel.refused) == 2  # both tried once, as asked
    assert {str(k.address) for k in first.refused} == {"10.96.0.1", "10.96.0.2"}
    assert not first.stale  # a refusal is not drift: no full pass for it
    second = proxier.sync(tracker.take(), full=False)  # at once: the substitutes
    assert second.sync.report.ok
    assert schedulers(kernel) == {"10.96.0.1": Scheduler.RR, "10.96.0.2": Scheduler.RR}
    a = next(k for k in kernel.state.services if str(k.address) == "10.96.0.1")
    assert len(kernel.state.dests[a]) == 1  # its endpoint too
    warnings = [w for w in proxier.warnings if "twos" in w]
    assert len(warnings) == 2
    assert any("default/a" in w for w in warnings)
    assert any("default/b" in w for w in warnings)
    for _ in range(3):  # never retried: no more refusals, no writes
        applied = len(kernel.applied)
        proxier.sync(tracker.take(), full=True)
        assert len(kernel.applied) == applied
    assert len(kernel.refused) == 2
    # a third Service asking for twos goes straight to the default: no refusal at all
    tracker.event(SERVICE, "ADDED", twos("c", "10.96.0.3"))
    result = proxier.sync(tracker.take(), full=False)
    assert result.sync.report.ok
    assert len(kernel.refused) == 2
    assert schedulers(kernel)["10.96.0.3"] is Scheduler.RR
    assert any("default/c" in w and "not available" in w for w in proxier.warnings)
    # another scheduler asked for: tried as asked, and served
    tracker.event(SERVICE, "MODIFIED", twos("a", "10.96.0.1", scheduler="lc"))
    proxier.sync(tracker.take(), full=False)
    assert schedulers(kernel)["10.96.0.1"] is Scheduler.LC
    assert not any("default/a" in w for w in proxier.warnings)


def test_a_refused_update_switches_to_the_default_and_keeps_the_endpoints():
    kernel = NoTwos()
    endpoints = slice_("a", endpoints=[ep("10.244.0.1"), ep("10.244.0.2")])
    tracker = tracker_with(twos("a", "10.96.0.1", scheduler="lc"), endpoints)
    proxier = Proxier(kernel=kernel, config=CONFIG)
    proxier.sync(tracker.take(), full=True)
    tracker.event(SERVICE, "MODIFIED", twos("a", "10.96.0.1"))
    proxier.sync(tracker.take(), full=False)
    assert kernel.refused
    proxier.sync(tracker.take(), full=False)
    assert schedulers(kernel) == {"10.96.0.1": Scheduler.RR}
    assert len(next(iter(kernel.state.dests.values()))) == 2


def test_a_failed_operation_is_retried_for_its_virtual_server_alone_with_backoff():
    clock = Clock(1000.0)
    kernel = FakeKernel()
    tracker = tracker_with(
        service("a", cluster_ips=("10.96.0.1",)),
        slice_("a", endpoints=[ep("10.244.0.1")]),
        service("b", cluster_ips=("10.96.0.2",)),
        slice_("b", endpoints=[ep("10.244.0.2")]),
    )
    proxier = Proxier(kernel=kernel, config=CONFIG, clock=clock)
    add = None
    original_apply = kernel.apply

    def failing_apply(plan, *, names=None, access=None):  # AddDest of b's endpoint always fails
        nonlocal add
        for op in plan:
            if isinstance(op, AddDest) and str(op.rs.key.address) == "10.244.0.2":
                add = op
                kernel.errors[op] = KernelError("EINVAL")
        return original_apply(plan, names=names, access=access)

    kernel.apply = failing_apply  # type: ignore[method-assign]
    proxier.sync(tracker.take(), full=True)
    assert add is not None
    tries = [clock.now]
    for _ in range(40):  # 40 s of partial passes, one a second
        clock.now += 1
        result = proxier.sync(tracker.take(), full=False)
        if result.sync.plan:
            tries.append(clock.now)
            assert set(result.sync.plan) == {add}  # b's endpoint alone, never a's
    assert [round(b - a) for a, b in zip(tries, tries[1:], strict=False)] == [1, 2, 4, 8, 16]
    assert proxier.backoff.next_in() is not None


def test_backoff_forgets_what_succeeded_and_counts_what_keeps_failing():
    clock = Clock(1000.0)
    backoff = Failing(policy=Backoff(first=1.0, cap=10.0), clock=clock)
    a, b = (
        VSKey(ip_address("10.96.0.1"), 80, Proto.TCP),
        VSKey(ip_address("10.96.0.2"), 80, Proto.TCP),
    )
    assert backoff.settle(None, {a: (), b: ()}) == set()
    assert backoff.next_in() == 1.0
    clock.now += 1
    assert backoff.due() == {a, b}
    assert backoff.settle([a, b], {b: ()}) == {a}  # a recovered, b waits 2 s now
    assert backoff.next_in() == 2.0
    assert backoff.settle(None, {b: ()}) == set()  # a full pass failing b again: 4 s
    assert backoff.next_in() == 4.0
    for _ in range(5):
        backoff.settle(None, {b: ()})
    assert backoff.next_in() == 10.0  # capped
    assert backoff.settle(None, {}) == {b}
    assert backoff.next_in() is None


def test_health_stays_up_over_sync_periods_while_an_operation_keeps_failing(caplog):
    """One endpoint's add fails on every try (EINVAL), one Service asks for twos: over
    eight sync periods /healthz stays 200, the failure is counted on every try but logged
    once, the refusal warned about once, and the rest is served."""
    agent, runner, clock = driven_agent()
    agent.feed(
        twos("web", "10.96.0.10"),
        slice_("web", endpoints=[ep("10.244.0.1"), ep("10.244.0.9")]),
    )
    agent.kernel.__class__ = NoTwos
    agent.kernel.refused = []  # type: ignore[attr-defined]
    real_apply = agent.kernel.apply

    def failing_apply(plan: Sequence[Op], *, names: Any = None, access: Any = None) -> ApplyReport:
        for op in plan:
            if isinstance(op, AddDest) and str(op.rs.key.address) == "10.244.0.9":
                agent.kernel.errors[op] = KernelError(f"{op}: EINVAL")
        return real_apply(plan, names=names, access=access)

    agent.kernel.apply = failing_apply  # type: ignore[method-assign]
    agent.health._clock = clock
    tries = 0
    with caplog.at_level(logging.INFO, logger="ipvsproxy.sync"):
        start = clock.now
        while clock.now - start < 8 * CONFIG.sync_period:
            agent.health.queued()  # as the agent does on every change/request
            runner.run_if_due()
            tries += 1
            assert agent.health.status()[0]
            clock.now += next_run(runner, clock)
    assert schedulers(agent.kernel) == {"10.96.0.10": Scheduler.RR}
    (dests,) = agent.kernel.state.dests.values()
    assert [str(k.address) for k in dests] == ["10.244.0.1"]
    errors = sample(
        agent.metrics, "ipvsproxy_kernel_operations_total", kind="AddDest", result="error"
    )
    assert errors >= 8
    failed = [r for r in caplog.records if r.getMessage().startswith("operation failed")]
    assert len(failed) == 1  # one line per object per change, not one per try
    refusals = [r for r in caplog.records if "twos" in r.getMessage() and r.levelname == "WARNING"]
    assert len(refusals) == 1


def test_an_unexpected_error_in_a_pass_is_logged_counted_and_retried(caplog):
    agent, runner, clock = driven_agent()
    agent.feed(service("web"), slice_("web", endpoints=[ep("10.244.0.1")]))
    real_plan = agent.sync.proxier.plan
    calls = []

    def broken(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real_plan(**kwargs)

    agent.sync.proxier.plan = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="ipvsproxy.sync"):
        assert runner.run_if_due() == 0
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)
    assert sample(agent.metrics, "ipvsproxy_syncs_total", result="error") == 1
    assert next_run(runner, clock) == 1  # retried soon
    clock.now += 1
    runner.run_if_due()
    assert agent.kernel.state.services  # the next pass did the work


def test_many_failures_with_one_error_are_named_a_few_times_then_counted(caplog):
    """A refused iptables-restore fails every object it carried with one error: the log names
    the first few and counts the rest in one line, instead of a line per object."""
    agent, runner, clock = driven_agent()
    endpoints = [ep(f"10.244.0.{n}") for n in range(1, 31)]
    agent.feed(service("web"), slice_("web", endpoints=endpoints))
    real_apply = agent.kernel.apply

    def failing_apply(plan: Sequence[Op], *, names: Any = None, access: Any = None) -> ApplyReport:
        for op in plan:
            if isinstance(op, AddDest):
                agent.kernel.errors[op] = KernelError("iptables-restore: line 7 failed")
        return real_apply(plan, names=names, access=access)

    agent.kernel.apply = failing_apply  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="ipvsproxy.sync"):
        runner.run_if_due()
    failed = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("operation failed")
    ]
    assert len(failed) == SAME_ERROR_LINES + 1, failed
    more = 30 - SAME_ERROR_LINES
    assert (
        failed[-1] == f"operation failed: {more} more operations: iptables-restore: line 7 failed"
    )


def test_a_reader_sees_what_is_served_and_changes_nothing_of_the_pass():
    """`status` asks what is served for the Services it shows (`Refusals.serving`) from its
    own thread: it sees the substitutes, and neither the pass's warnings nor what it
    remembers of the kernel's refusals move, whatever the reader asks about."""
    kernel = NoTwos()
    tracker = tracker_with(twos("a", "10.96.0.1"), twos("b", "10.96.0.2"))
    proxier = Proxier(kernel=kernel, config=CONFIG)
    proxier.sync(tracker.take(), full=True)
    proxier.sync(tracker.take(), full=False)
    state = proxier.index.desired().state
    served = proxier.refusals.serving(state)
    assert {vs.scheduler for vs in served.services.values()} == {Scheduler.RR}
    assert {vs.scheduler for vs in state.services.values()} == {Scheduler.TWOS}
    warnings = proxier.warnings
    other = {  # a asks for lc now (the pass would forget its refusal), a third for twos
        key: replace(vs, scheduler=Scheduler.LC) if str(key.address) == "10.96.0.1" else vs
        for key, vs in state.services.items()
    }
    third = VirtualServer(VSKey(ip_address("10.96.0.3"), 80, Proto.TCP), Scheduler.TWOS)
    asked = replace(state, services={**other, third.key: third})
    shown = proxier.refusals.serving(asked).services
    assert shown[third.key].scheduler is Scheduler.RR  # known missing
    assert {str(k.address): vs.scheduler for k, vs in shown.items()}["10.96.0.1"] is Scheduler.LC
    assert proxier.warnings == warnings
    result = proxier.sync(tracker.take(), full=False)  # the pass: still the substitutes
    assert result.sync.report.ok
    assert len(kernel.refused) == 2
    assert schedulers(kernel) == {"10.96.0.1": Scheduler.RR, "10.96.0.2": Scheduler.RR}
