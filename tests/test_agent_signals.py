"""The agent's SIGTERM/SIGINT handling: the handler itself takes no lock and logs nothing."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from ipvsproxy.agent import _signals


def test_a_real_sigterm_halts_once_and_is_logged_outside_the_handler(caplog):
    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    halted = threading.Event()
    with _signals(halted.set):
        os.kill(os.getpid(), signal.SIGTERM)
        assert halted.wait(5)
    (record,) = [r for r in caplog.records if "received SIGTERM: stopping" in r.message]
    assert record.threadName == "signals"  # not the main thread, where the handler ran


def test_the_handler_returns_while_the_main_thread_holds_the_lock_halt_needs(caplog):
    """The deadlock of issue 14: a signal arriving while the main thread holds a lock that
    halting (or logging) takes again. The handler must return at once; the halt follows."""
    caplog.set_level(logging.INFO, logger="ipvsproxy.agent")
    lock = threading.Lock()  # stands for the runner's Event lock, or a logging handler's
    halted_by: list[str] = []

    def halt() -> None:
        with lock:
            halted_by.append(threading.current_thread().name)

    with _signals(halt):
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler)
        with lock:  # the main thread is inside the lock when the signal comes
            before = len(caplog.records)
            started = time.monotonic()
            handler(signal.SIGINT, None)
            assert time.monotonic() - started < 2.0  # returned: nothing waited for the lock
            # nothing logged from inside the handler (the "signals" thread may log already:
            # it reads the pipe at once, then waits for the lock in halt())
            main = threading.main_thread().name
            assert not [r for r in caplog.records[before:] if r.threadName == main]
            assert halted_by == []
        deadline = time.monotonic() + 5
        while not halted_by:
            assert time.monotonic() < deadline, "the signal was never acted on"
            time.sleep(0.01)
    assert halted_by == ["signals"]
    assert any("received SIGINT: stopping" in r.message for r in caplog.records)


def test_previous_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with _signals(lambda: None):
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_outside_the_main_thread_no_handler_is_installed():
    seen: list[object] = []

    def body() -> None:
        with _signals(lambda: None):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join(5)
    assert seen == [before]
