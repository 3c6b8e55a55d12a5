"""Slow start on a fake clock: the agent's passes over FakeKernel ramp a new endpoint's
weight step by step (sync/slowstart.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from ipaddress import ip_address

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.api import NodeView
from ipvsproxy.config import Config
from ipvsproxy.model import IpvsState, Proto, RealServer, RSKey, VirtualServer, VSKey
from ipvsproxy.schedulers import SCHEDULER_ANNOTATION, Scheduler
from ipvsproxy.sync.desired import translate_service
from ipvsproxy.sync.slowstart import (
    FULL_WEIGHT,
    SLOW_START_ANNOTATION,
    STEPS,
    Ramp,
    SlowStart,
    ramp_weight,
)
from tests.factories import ep, parse_service, parse_slice, service, slice_
from tests.support import AGENT_CONFIG, Agent, Clock, driven_agent, next_run

A, B, C = "10.244.0.1", "10.244.0.2", "10.244.0.3"
KEY = VSKey(ip_address("10.96.0.10"), 80, Proto.TCP)
WINDOW = 10.0  # steps every 2 s


def web(*, scheduler="wrr", slow_start: str | None = "10s", cluster_ip="10.96.0.10"):
    annotations = {SCHEDULER_ANNOTATION: scheduler}
    if slow_start is not None:
        annotations[SLOW_START_ANNOTATION] = slow_start
    return service("web", annotations=annotations, cluster_ips=(cluster_ip,))


def endpoints(*addresses: str):
    return slice_("web", endpoints=[ep(a) for a in addresses])


def weights(agent) -> dict[str, int]:
    return {str(rs.address): d.weight for rs, d in agent.kernel.state.dests[KEY].items()}


def ramps(agent: Agent) -> tuple[Ramp, ...]:
    """What the agent's ramps are doing (the accessor a `status` reads)."""
    slow_start = agent.sync.proxier.slow_start
    assert slow_start is not None  # the agent's proxier ramps
    return slow_start.ramps()


def sync(agent, runner, *objects) -> None:
    """Hand the agent the objects (what is missing is gone) and run the pass it asks for."""
    agent.feed(*objects)
    runner.request()
    assert runner.run_if_due() == 0


def ramp_to_the_end(agent, runner, clock, endpoint: str) -> list[int]:
    """Run the passes the agent asks for while it ramps: the endpoint's weight after each."""
    seen = []
    while ramps(agent):
        clock.now += next_run(runner, clock)
        assert runner.run_if_due() == 0
        seen.append(weights(agent)[endpoint])
    return seen


def serving_with_a_new_endpoint(config: Config = AGENT_CONFIG):
    """An agent serving A and B at full weight, then given C 3 s later."""
    agent, runner, clock = driven_agent(config)
    sync(agent, runner, web(), endpoints(A, B))
    clock.now += 3
    sync(agent, runner, web(), endpoints(A, B, C))
    return agent, runner, clock


def test_the_steps_1_2_4_6_8_then_full():
    assert [ramp_weight(10, t, WINDOW) for t in (0, 1.9, 2, 4, 6, 8, 9.9, 10, 99)] == [
        1, 1, 2, 4, 6, 8, 8, 10, 10,
    ]  # fmt: skip


def test_a_new_endpoint_ramps_step_by_step_in_partial_passes_woken_at_each_step():
    agent, runner, clock = driven_agent()
    sync(agent, runner, web(), endpoints(A, B))
    assert weights(agent) == {A: FULL_WEIGHT, B: FULL_WEIGHT}  # the first endpoints: at once
    assert ramps(agent) == ()
    clock.now += 3
    sync(agent, runner, web(), endpoints(A, B, C))
    started, observations = clock.now, agent.kernel.observations
    assert weights(agent) == {A: 10, B: 10, C: 1}
    assert next_run(runner, clock) == WINDOW / STEPS  # woken for the next step
    assert ramp_to_the_end(agent, runner, clock, C) == [2, 4, 6, 8, 10]
    assert clock.now - started == WINDOW
    assert agent.kernel.observations == observations  # partial passes carried the steps
    assert next_run(runner, clock) == AGENT_CONFIG.sync_period  # done: no more early passes


def test_the_ramp_is_readable_while_it_runs():
    agent, runner, clock = serving_with_a_new_endpoint()
    started = clock.now
    clock.now += 4.5
    runner.retry_after(0)
    runner.run_if_due()
    (ramp,) = ramps(agent)
    endpoint = RSKey(ip_address(C), 8080)
    assert ramp == Ramp(KEY, endpoint, started, started + WINDOW, target=10, weight=4)


def test_a_restarted_agent_ramps_nothing_the_kernel_already_serves():
    agent, runner, clock = serving_with_a_new_endpoint()
    clock.now += 5
    runner.run_if_due()
    assert weights(agent)[C] == 4  # half way, the agent dies
    restarted, runner, clock = driven_agent()
    restarted.kernel.state = agent.kernel.state
    sync(restarted, runner, web(), endpoints(A, B, C))
    assert weights(restarted) == {A: 10, B: 10, C: 10}  # C served: full at once
    assert ramps(restarted) == ()
    assert next_run(runner, clock) == AGENT_CONFIG.sync_period
    # what the kernel does not serve yet is new to a restarted agent too
    restarted, runner, clock = driven_agent()
    restarted.kernel.state = agent.kernel.state
    sync(restarted, runner, web(), endpoints(A, B, C, "10.244.0.4"))
    assert weights(restarted)["10.244.0.4"] == 1


def test_an_endpoint_that_leaves_and_comes_back_ramps_again():
    agent, runner, clock = serving_with_a_new_endpoint()
    ramp_to_the_end(agent, runner, clock, C)
    key = RSKey(ip_address(C), 8080)
    agent.kernel.conns[KEY] = {key: (1, 0)}  # an open connection: it drains at weight 0
    clock.now += 1
    sync(agent, runner, web(), endpoints(A, B))
    assert weights(agent)[C] == 0
    clock.now += 1
    sync(agent, runner, web(), endpoints(A, B, C))  # back while draining
    assert weights(agent)[C] == 1
    assert ramp_to_the_end(agent, runner, clock, C) == [2, 4, 6, 8, 10]
    agent.kernel.conns[KEY] = {}
    sync(agent, runner, web(), endpoints(A, B))  # gone for good ...
    assert C not in weights(agent)
    sync(agent, runner, web(), endpoints(A, B, C))  # ... and back
    assert weights(agent)[C] == 1


def test_a_full_resync_mid_ramp_neither_restarts_nor_finishes_it():
    agent, runner, clock = serving_with_a_new_endpoint()
    clock.now += WINDOW / STEPS * 2  # the third step: weight 4
    runner.run_if_due()
    assert weights(agent)[C] == 4
    observations = agent.kernel.observations
    clock.now += 1
    agent.sync.resync()
    assert runner.run_if_due() == 0
    assert agent.kernel.observations == observations + 1  # a full pass: read the kernel
    assert weights(agent)[C] == 4
    assert next_run(runner, clock) == 1  # the next step when it was due
    assert ramp_to_the_end(agent, runner, clock, C) == [6, 8, 10]


def test_a_node_wide_window_ramps_every_service_and_0s_turns_it_off_for_one():
    config = replace(AGENT_CONFIG, scheduler=Scheduler.WLC, slow_start=WINDOW)
    agent, runner, clock = driven_agent(config)
    plain = service("web")
    sync(agent, runner, plain, endpoints(A, B))
    sync(agent, runner, plain, endpoints(A, B, C))
    assert weights(agent) == {A: 10, B: 10, C: 1}
    off = service("web", annotations={SLOW_START_ANNOTATION: "0s"})
    sync(agent, runner, off, endpoints(A, B, C))
    assert weights(agent) == {A: 1, B: 1, C: 1}  # as without slow start, at once
    assert ramps(agent) == ()


NODE = NodeView("node-a")


@pytest.mark.parametrize(
    ("value", "warning"),
    [
        ("warm", "ipvsproxy.io/slow-start: 'warm' is not a duration like 30s"),
        ("2h", "ipvsproxy.io/slow-start: '2h' is longer than 3600s"),
        ("-5s", "is not a duration"),
        ("1m 30s", "is not a duration"),
    ],
)
def test_a_bad_annotation_is_one_warning_naming_the_service_and_slow_start_is_off(value, warning):
    svc = parse_service(service("web", annotations={SLOW_START_ANNOTATION: value}))
    config = replace(AGENT_CONFIG, scheduler=Scheduler.WRR, slow_start=30.0)
    got = translate_service(svc, [parse_slice(endpoints(A))], NODE, config)
    (entry,) = got.entries.values()
    assert (entry.slow_start, [rs.weight for rs in entry.dests.values()]) == (0, [1])
    (text,) = got.warnings
    assert text.startswith("Service default/web: ")
    assert warning in text
    assert text.endswith("slow start is off")


@pytest.mark.parametrize(("value", "seconds"), [("1m30s", 90), ("45", 45), ("1h", 3600)])
def test_a_good_annotation_sets_the_window_and_full_weight(value, seconds):
    svc = parse_service(web(slow_start=value))
    got = translate_service(svc, [parse_slice(endpoints(A))], NODE, AGENT_CONFIG)
    (entry,) = got.entries.values()
    assert (entry.slow_start, [rs.weight for rs in entry.dests.values()]) == (seconds, [10])
    assert got.warnings == ()


def test_a_scheduler_ignoring_weights_is_warned_about_once_and_nothing_ramps(caplog):
    agent, runner, clock = driven_agent()
    with caplog.at_level(logging.WARNING):
        sync(agent, runner, web(scheduler="rr"), endpoints(A, B))
        sync(agent, runner, web(scheduler="rr"), endpoints(A, B, C))
        clock.now += AGENT_CONFIG.sync_period
        sync(agent, runner, web(scheduler="rr"), endpoints(A, B, C))  # a full pass
    assert weights(agent) == {A: 1, B: 1, C: 1}
    assert ramps(agent) == ()
    lines = [r.getMessage() for r in caplog.records if "slow start" in r.getMessage()]
    assert lines == [
        "Service default/web: slow start has no effect with scheduler rr, which ignores "
        "weights (it needs one of wrr, wlc, lblc, lblcr, sh, sed, nq, fo, ovf, mh, twos); "
        "slow start is off"
    ]


def test_a_service_that_switches_to_a_scheduler_ignoring_weights_stops_ramping():
    agent, runner, clock = serving_with_a_new_endpoint()
    assert weights(agent)[C] == 1
    sync(agent, runner, web(scheduler="lc"), endpoints(A, B, C))
    assert weights(agent) == {A: 1, B: 1, C: 1}
    assert ramps(agent) == ()


def test_a_new_virtual_server_gets_its_endpoints_at_full_weight_at_once():
    """The first endpoints of a virtual server, even of a Service already serving on
    another: nothing else serves there to take the load while they warm up."""
    agent, runner, clock = driven_agent()
    sync(agent, runner, web(), endpoints(A, B))
    sync(agent, runner, web(cluster_ip="10.96.0.11"), endpoints(A, B))
    (key,) = agent.kernel.state.dests
    assert str(key.address) == "10.96.0.11"
    assert {rs.weight for rs in agent.kernel.state.dests[key].values()} == {10}


# ---- properties -----------------------------------------------------------------------------


@given(
    full=st.integers(2, 1000),
    window=st.floats(0.001, 3600),
    times=st.lists(st.floats(0, 7200), min_size=1),
)
def test_a_ramp_never_exceeds_full_never_reaches_0_and_never_goes_down(full, window, times):
    seen = [ramp_weight(full, t, window) for t in sorted(times)]
    assert all(1 <= w <= full for w in seen)
    assert seen == sorted(seen)
    assert all((w == full) == (t >= window) for w, t in zip(seen, sorted(times), strict=True))


@given(
    old=st.sets(st.integers(1, 50), min_size=1, max_size=5),
    new=st.sets(st.integers(51, 99), max_size=5),
    times=st.lists(st.floats(0, 30), max_size=6),
)
def test_held_weights_stay_between_1_and_full_and_never_go_down(old, new, times):
    clock = Clock()
    ramp = SlowStart(clock=clock)
    vs = VirtualServer(KEY, Scheduler.WRR)

    def table(hosts, weight_of):
        dests = {
            RSKey(ip_address(f"10.244.1.{h}"), 80): RealServer(
                RSKey(ip_address(f"10.244.1.{h}"), 80), weight_of(h)
            )
            for h in hosts
        }
        return IpvsState({KEY: vs}, {KEY: dests})

    observed = table(old, lambda h: 10)
    desired = table(old | new, lambda h: 10)
    last: dict[RSKey, int] = {}
    for t in sorted(times):
        clock.now = t
        held = ramp.hold(desired, observed, {KEY: 20.0})
        for rk, rs in held.dests[KEY].items():
            assert 1 <= rs.weight <= 10
            assert rs.weight == 10 or rk.address.packed[-1] > 50  # only new ones ramp
            assert rs.weight >= last.get(rk, 1)
            last[rk] = rs.weight
        observed = held  # what the kernel took
