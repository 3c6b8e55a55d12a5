"""The bounded-frequency runner, driven by a fake clock: no sleeping."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipvsproxy.sync.runner import Runner
from tests.support import Clock


def make(min_interval=1.0, max_interval=30.0):
    clock = Clock(100.0)
    runs: list[float] = []
    runner = Runner(
        lambda: runs.append(clock.now),
        min_interval=min_interval,
        max_interval=max_interval,
        clock=clock,
    )
    return runner, clock, runs


def test_first_run_is_immediate_then_periodic():
    runner, clock, runs = make()
    assert runner.run_if_due() == 0
    assert runner.run_if_due() == pytest.approx(30)
    clock.now += 30
    assert runner.run_if_due() == 0
    assert runs == [100, 130]


def test_a_call_that_did_not_run_does_not_hold_back_the_next_run():
    """The agent's pass before every kind has listed returns False: nothing ran, so the pass
    the last list asks for runs at once, not min_interval later (at start, a second of no
    proxy on the node); and an idle runner still waits for a request, it does not spin."""
    clock = Clock(100.0)
    ready = [False]
    runs: list[float] = []

    def attempt() -> bool:
        if not ready[0]:
            return False
        runs.append(clock.now)
        return True

    runner = Runner(attempt, min_interval=1.0, max_interval=30.0, clock=clock)
    assert runner.run_if_due() == 0  # called; it could not run
    assert runner.run_if_due() == pytest.approx(30)  # nothing asked: no spinning
    clock.now += 0.02
    ready[0] = True
    runner.request()  # the last list came
    assert runner.run_if_due() == 0
    assert runs == [100.02]
    clock.now += 0.2
    runner.request()
    assert runner.run_if_due() == pytest.approx(0.8)  # real runs are rate-limited as before


def test_requests_are_rate_limited_not_lost():
    runner, clock, runs = make()
    runner.run_if_due()
    clock.now += 0.2
    runner.request()
    runner.request()
    assert runner.run_if_due() == pytest.approx(0.8)  # not before min_interval
    clock.now += 0.8
    assert runner.run_if_due() == 0
    assert runs == [100, 101]
    assert runner.run_if_due() == pytest.approx(30)  # both requests served by one run


def test_both_intervals_count_from_the_end_of_the_last_run():
    """kube-proxy's BoundedFrequencyRunner: a run longer than the period is not followed at
    once by a periodic one, nor a request's run sooner than min_interval after it ended."""
    clock = Clock(100.0)
    runs: list[float] = []

    def slow() -> None:
        runs.append(clock.now)
        clock.now += 45  # longer than the period

    runner = Runner(slow, min_interval=1.0, max_interval=30.0, clock=clock)
    assert runner.run_if_due() == 0  # 100 -> 145
    assert runner.run_if_due() == pytest.approx(30)
    runner.request()
    assert runner.run_if_due() == pytest.approx(1)
    assert runs == [100]


def test_retry_after_comes_sooner_than_the_period():
    runner, clock, runs = make()
    runner.run_if_due()
    runner.retry_after(5)
    assert runner.run_if_due() == pytest.approx(5)
    clock.now += 5
    runner.run_if_due()
    assert runs == [100, 105]


def test_queued_at_marks_the_oldest_unserved_request():
    runner, clock, _ = make()
    runner.run_if_due()
    assert runner.queued_at is None
    runner.request()
    clock.now += 0.5
    runner.request()
    assert runner.queued_at == 100
    clock.now += 0.5
    runner.run_if_due()
    assert runner.queued_at is None


@given(st.lists(st.tuples(st.sampled_from(["request", "retry", "tick"]), st.floats(0, 50))))
def test_never_more_often_than_min_nor_rarer_than_max(steps):
    runner, clock, runs = make(min_interval=1.0, max_interval=30.0)
    runner.run_if_due()
    for action, amount in steps:
        if action == "request":
            runner.request()
        elif action == "retry":
            runner.retry_after(amount)
        clock.now += min(amount, 0.25 if action == "tick" else amount)
        while runner.run_if_due() == 0:
            pass
    gaps = [b - a for a, b in zip(runs, runs[1:], strict=False)]
    assert all(gap >= 1.0 - 1e-9 for gap in gaps)
    # a run is never more than max_interval overdue (the clock moves at most 50 per step)
    assert runner.due(clock.now) <= runs[-1] + 30.0


def test_loop_runs_on_request_and_stops():
    ran = threading.Event()
    count = [0]

    def fn() -> None:
        count[0] += 1
        if count[0] == 2:
            ran.set()

    runner = Runner(fn, min_interval=0.0, max_interval=60.0)
    thread = threading.Thread(target=runner.loop)
    thread.start()
    runner.request()
    assert ran.wait(5)
    runner.stop()
    thread.join(5)
    assert not thread.is_alive()


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError, match="min_interval"):
        Runner(lambda: None, min_interval=5, max_interval=1)
