"""overlap.alongside: the work runs on a second thread while the block runs, its result or
error reaches the block, and nothing of it outlives the block."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from ipvsproxy.overlap import SWITCH_INTERVAL, alongside

WAIT = 5.0  # seconds; only reached when the work does not run alongside


def test_the_work_runs_while_the_block_runs():
    started, answered = threading.Event(), threading.Event()

    def work() -> str:
        started.set()
        return "done" if answered.wait(WAIT) else "the block never answered"

    with alongside(work, name="test") as outcome:
        assert started.wait(WAIT), "the work did not start before the block went on"
        answered.set()
        assert outcome.result() == "done"


def test_the_work_error_is_raised_by_result():
    def work() -> None:
        raise ValueError("bad input")

    with alongside(work, name="test") as outcome, pytest.raises(ValueError, match="bad input"):
        outcome.result()


def test_leaving_the_block_waits_for_the_work_even_unread():
    finished: list[bool] = []

    def work() -> None:
        time.sleep(0.05)
        finished.append(True)

    with alongside(work, name="test"):
        pass
    assert finished == [True]


def test_the_switch_interval_is_lowered_inside_and_restored_after():
    before = sys.getswitchinterval()
    with alongside(lambda: None, name="test"):
        assert sys.getswitchinterval() == min(before, SWITCH_INTERVAL)
    assert sys.getswitchinterval() == before


def test_an_error_in_the_block_still_waits_and_restores():
    before = sys.getswitchinterval()
    finished: list[bool] = []

    def work() -> None:
        time.sleep(0.05)
        finished.append(True)

    with pytest.raises(RuntimeError), alongside(work, name="test"):
        raise RuntimeError("the block failed")
    assert finished == [True]
    assert sys.getswitchinterval() == before
