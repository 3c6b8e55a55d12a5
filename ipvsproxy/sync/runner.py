"""A bounded-frequency runner: run a function at most every `min_interval`, at least every
`max_interval`, and soon after a request (kube-proxy's BoundedFrequencyRunner, threaded).
As there, both intervals count from the end of the last run: a run that takes longer than
`max_interval` (a first sync of a large cluster on a slow node) is not followed at once by
the periodic one.

Owns: `Runner`. Other threads call `request()` (something changed) or `retry_after(s)` (the
last run failed); one thread calls `loop()`. A function that returns False did not run (the
agent's pass before every kind has listed): the runner does not count it, so the first real
run is not held back by min_interval (kube-proxy does not start its runner before then). The
decision of when to run is `due(now)`, a pure function of the runner's state and the injected
clock, so tests drive it without sleeping.

Imports: the standard library.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class Runner:
    def __init__(
        self,
        fn: Callable[[], bool | None],
        *,
        min_interval: float,
        max_interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_interval < 0 or max_interval <= 0 or min_interval > max_interval:
            raise ValueError(f"need 0 <= min_interval ({min_interval}) <= max_interval")
        self._fn = fn
        self.min_interval = min_interval
        self.max_interval = max_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._pending = True  # the first run is due at once
        self._retry_at = math.inf
        self._last_run = -math.inf  # min_interval counts from here: the last real run
        self._last_call = -math.inf  # max_interval from here: the last call, run or not
        self.queued_at: float | None = None  # when the oldest unserved request came

    def request(self) -> None:
        """Something changed: run soon, but not before min_interval since the last run."""
        with self._lock:
            self._pending = True
            if self.queued_at is None:
                self.queued_at = self._clock()
        self._wake.set()

    def retry_after(self, seconds: float) -> None:
        """Run again within `seconds` (still no sooner than min_interval after the last run)."""
        with self._lock:
            self._retry_at = min(self._retry_at, self._clock() + seconds)
        self._wake.set()

    def due(self, now: float) -> float:
        """The time the next run is due."""
        with self._lock:
            earliest = self._last_run + self.min_interval
            at = self._last_call + self.max_interval
            if self._pending:
                at = min(at, max(now, earliest))
            return min(at, max(self._retry_at, earliest))

    def run_if_due(self) -> float:
        """Run if due; return the seconds until the next run is due (0: ran now)."""
        now = self._clock()
        at = self.due(now)
        if at > now:
            return at - now
        with self._lock:
            self._pending = False
            self._retry_at = math.inf
            self.queued_at = None
        ran: bool | None = True
        try:
            ran = self._fn()
        finally:
            with self._lock:
                self._last_call = self._clock()
                if ran is not False:
                    self._last_run = self._last_call
        return 0.0

    def loop(self) -> None:
        """Run until `stop()`; returns after the run in progress (if any) finishes."""
        while not self._stopped.is_set():
            delay = self.run_if_due()
            if delay > 0:
                self._wake.wait(delay)
                self._wake.clear()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
